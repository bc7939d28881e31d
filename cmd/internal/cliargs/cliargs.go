// Package cliargs keeps the programs' messages about their command line
// from echoing a secret: an argument that may hold one (a broker or
// database URL with a password, given without its flag, or as the value of
// the wrong flag) is named by its position instead.
package cliargs

import (
	"fmt"
	"strconv"
	"strings"
)

// MayHoldSecret reports whether a command-line argument looks like it may
// hold a password or token: a URL's userinfo (an '@'), or a connection
// string's password, secret or token.
func MayHoldSecret(arg string) bool {
	if strings.Contains(arg, "@") {
		return true
	}
	l := strings.ToLower(arg)
	for _, word := range []string{"password", "passwd", "pwd=", "secret", "token"} {
		if strings.Contains(l, word) {
			return true
		}
	}
	return false
}

// Redact is msg, a message about the command line args, without the
// arguments that may hold a secret (MayHoldSecret), as written or quoted
// (%q): each is replaced by "<argument N, not shown: …>".
func Redact(msg string, args []string) string {
	for i, a := range args {
		if a == "" || !MayHoldSecret(a) {
			continue
		}
		hidden := fmt.Sprintf("<argument %d, not shown: it may hold a secret>", i+1)
		msg = strings.ReplaceAll(msg, strconv.Quote(a), hidden)
		msg = strings.ReplaceAll(msg, a, hidden)
	}
	return msg
}

// Unexpected is the complaint about args a program that takes flags only
// was given after them: how many, not what.
func Unexpected(args []string) error {
	return fmt.Errorf("unexpected arguments (%d, not shown: one may hold a secret; a flag's value goes right after the flag, like -flag URL): it takes flags only", len(args))
}
