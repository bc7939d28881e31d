package termsafe_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/termsafe"
)

// What a terminal would act on is escaped, each kind as it is named;
// everything else is kept, byte for byte.
func TestLineAndText(t *testing.T) {
	for in, want := range map[string]string{
		"plain text, ünïcödé, 日本語, \uFFFD, back\\slash": "plain text, ünïcödé, 日本語, \uFFFD, back\\slash",
		"\x1b[2J\x1b[31m":  `\x1b[2J\x1b[31m`,
		"bell\a":           `bell\x07`,
		"nul\x00":          `nul\x00`,
		"del\x7f":          `del\x7f`,
		"csi\u009b1m":      `csi\u009b1m`,
		"rlo\u202eexe.txt": `rlo\u202eexe.txt`,
		"isolates\u2066\u2069 marks\u200e\u200f\u061c": `isolates\u2066\u2069 marks\u200e\u200f\u061c`,
		"separators\u2028\u2029":                       `separators\u2028\u2029`,
		"not utf-8 \xff\xc3(":                          `not utf-8 \xff\xc3(`,
		"cr\r":                                         `cr\r`,
	} {
		assert.Equal(t, want, termsafe.Line(in), "%q", in)
		assert.Equal(t, want, termsafe.Text(in), "%q", in)
	}
	assert.Equal(t, `two\nlines\tand a tab`, termsafe.Line("two\nlines\tand a tab"))
	assert.Equal(t, "two\nlines\tand a tab", termsafe.Text("two\nlines\tand a tab"))
}

// Sentence reads as one line: line breaks and tabs, with the spaces
// around them, are one space; what a terminal acts on is escaped still.
func TestSentence(t *testing.T) {
	assert.Equal(t, "failed to connect: 127.0.0.1:1: refused 127.0.0.1:1: refused",
		termsafe.Sentence("failed to connect:\n\t127.0.0.1:1: refused\n\t127.0.0.1:1: refused"))
	assert.Equal(t, "a b c d", termsafe.Sentence("a \r\n b\tc\n\n\nd"))
	assert.Equal(t, "two  spaces kept", termsafe.Sentence("two  spaces kept"))
	assert.Equal(t, `forged \x1b[2J line`, termsafe.Sentence("forged\n\x1b[2J line"))
	assert.Equal(t, `bidi\u202e`, termsafe.Sentence("bidi\u202e"))
}

// JSON keeps the values as encoded, character for character, with what
// encoding/json leaves raw and a terminal acts on escaped.
func TestJSON(t *testing.T) {
	in := map[string]string{"k\u202e": "v\x1b[2J\a\x7f\u009b\u202e\u2066日本"}
	b, err := json.MarshalIndent(in, "", "  ")
	require.NoError(t, err)
	assert.Contains(t, string(b), "\u202e", "encoding/json leaves it raw")
	safe := termsafe.JSON(b)
	assert.NotContains(t, string(safe), "\u202e")
	assert.NotContains(t, string(safe), "\x7f")
	assert.NotContains(t, string(safe), "\u009b")
	assert.Contains(t, string(safe), "日本")
	var out map[string]string
	require.NoError(t, json.Unmarshal(safe, &out))
	assert.Equal(t, in, out)
	plain := []byte(`{"a": "b"}`)
	assert.Equal(t, plain, termsafe.JSON(plain))
}
