package readme

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// between returns the text of s between the open and close markers.
func between(t *testing.T, s, open, close string) string {
	t.Helper()
	_, rest, ok := strings.Cut(s, open)
	require.True(t, ok, "marked with %s", open)
	block, _, ok := strings.Cut(rest, close)
	require.True(t, ok, "and ended with %s", close)
	return block
}

// qualified lists the distinct package-qualified names of pgsaga's
// packages (saga.X, steps.X) that code uses.
func qualified(code string) []string {
	names := regexp.MustCompile(`\b(?:saga|steps|sagatest|idempotency|delivery)\.[A-Z]\w*`).FindAllString(code, -1)
	slices.Sort(names)
	return slices.Compact(names)
}

// The trip program (docs/examples/trip), copied into a module of its own,
// books a hotel and charges a card over HTTP through steps.Call: each
// service acts once per key, a declined card cancels the booking. The
// README's trip step is the program's, verbatim, in at most 15 lines and
// with at most 3 names beyond the README program's (the core path).
func TestTheTripProgramCallsEachServiceOncePerKey(t *testing.T) {
	t.Parallel()
	gobin, root := goAndRoot(t)
	code, err := os.ReadFile(filepath.Join(root, "docs", "examples", "trip", "main.go"))
	require.NoError(t, err)
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	require.NoError(t, err)

	step := between(t, string(code), "// <!-- trip-step -->\n", "\t// <!-- /trip-step -->")
	var dedented []string
	for line := range strings.Lines(step) {
		dedented = append(dedented, strings.TrimPrefix(line, "\t"))
	}
	shown := between(t, string(readme), "<!-- trip-step -->\n```go\n", "```\n<!-- /trip-step -->")
	assert.Equal(t, strings.Join(dedented, ""), shown, "the README shows the program's step as it is")
	assert.LessOrEqual(t, strings.Count(shown, "\n"), 15, "the step is at most 15 lines")
	core := qualified(program(t, string(readme)))
	var beyond []string
	for _, name := range qualified(shown) {
		if !slices.Contains(core, name) {
			beyond = append(beyond, name)
		}
	}
	assert.LessOrEqual(t, len(beyond), 3, "names beyond the core path: %v", beyond)
	t.Logf("the README's trip step: %d lines; names beyond the core path (%d names): %v", strings.Count(shown, "\n"), len(core), beyond)

	dir := userModule(t, map[string]string{"main.go": string(code)})
	db := testdb.Fresh(t)
	out := runGo(t, gobin, dir, []string{"DATABASE_URL=" + db.URL}, "run", ".")
	assert.Equal(t, "trip-1: completed, hotel room-trip-1\n"+
		"trip-2: compensated, hotel room-trip-2 (charge: card declined)\n"+
		"hotel: 2 booked, 1 cancelled; bank: 2 charges; 5 requests\n", out)
}
