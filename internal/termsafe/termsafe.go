// Package termsafe makes text that comes from elsewhere (a database, a
// message, a command line) safe to show on a terminal: the characters a
// terminal would act on instead of showing are written as escapes, so
// that what is printed cannot clear the screen, move the cursor, retitle
// the window, ring the bell or reorder what follows.
//
// Escaped: C0 controls as \x1b (newline, tab and carriage return as \n,
// \t, \r; Text keeps newlines and tabs), DEL as \x7f, C1 controls as
// \u009b, the bidirectional formatting characters (U+061C, U+200E,
// U+200F, U+202A to U+202E, U+2066 to U+2069) and the line and paragraph
// separators (U+2028, U+2029) as \u202e, and each byte that is not UTF-8
// as \xff. Everything else, backslashes included, is kept as it is.
package termsafe

import (
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"
)

// Line is s to print as one line (a table cell, a message): newlines and
// tabs are escaped too.
func Line(s string) string { return escape(s, false) }

// Sentence is s to print as one line to be read (an error): each run of
// white space that holds a newline, a tab or a carriage return (pgx joins
// the addresses a connection tried with ":\n\t") is one space, and the
// rest is escaped as by Line.
func Sentence(s string) string {
	return Line(layoutRun.ReplaceAllString(s, " "))
}

// layoutRun is a run of white space with a line break or a tab in it.
var layoutRun = regexp.MustCompile(`[ ]*[\t\r\n][\t\r\n ]*`)

// Text is s to print as text that may span lines: newlines and tabs are
// kept.
func Text(s string) string { return escape(s, true) }

// Clean reports whether Text leaves s as it is: UTF-8 with nothing a
// terminal (or a page) would act on but newlines and tabs.
func Clean(s string) bool { return firstUnsafe(s, true) < 0 }

func escape(s string, layout bool) string {
	i := firstUnsafe(s, layout)
	if i < 0 {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	b.WriteString(s[:i])
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case !unsafe(r, layout):
			b.WriteString(s[i : i+size])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x80:
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			fmt.Fprintf(&b, `\u%04x`, r)
		}
		i += size
	}
	return b.String()
}

// firstUnsafe is the index in s of the first byte escape changes, or -1.
func firstUnsafe(s string, layout bool) int {
	for i, r := range s {
		if unsafe(r, layout) || r == utf8.RuneError && !strings.HasPrefix(s[i:], "\uFFFD") {
			return i
		}
	}
	return -1
}

// unsafe reports whether a terminal acts on r rather than showing it
// (newline and tab are layout: safe when layout is).
func unsafe(r rune, layout bool) bool {
	switch {
	case r == '\n' || r == '\t':
		return !layout
	case r < 0x20, 0x7f <= r && r < 0xa0:
		return true
	}
	return bidi(r) || r == '\u2028' || r == '\u2029'
}

// bidi reports whether r is a bidirectional formatting character: it
// reorders the text around it as a terminal or a browser shows it.
func bidi(r rune) bool {
	return r == '\u061c' || r == '\u200e' || r == '\u200f' || '\u202a' <= r && r <= '\u202e' || '\u2066' <= r && r <= '\u2069'
}

// JSON is JSON text b (as encoding/json writes it) with the characters
// encoding/json leaves as they are but a terminal acts on (DEL, C1
// controls, bidirectional formatting characters) written as \u escapes:
// the same JSON values, character for character, safe to show. b must be
// valid UTF-8, as encoding/json writes it; such characters can only be in
// its strings, where a \u escape means the character itself.
func JSON(b []byte) []byte {
	var out []byte
	last := 0
	for i := 0; i < len(b); {
		r, size := utf8.DecodeRune(b[i:])
		if r != '\n' && r != '\t' && r != '\r' && unsafe(r, true) {
			if out == nil {
				out = make([]byte, 0, len(b)+16)
			}
			out = append(out, b[last:i]...)
			out = fmt.Appendf(out, `\u%04x`, r)
			last = i + size
		}
		i += size
	}
	if out == nil {
		return b
	}
	return append(out, b[last:]...)
}
