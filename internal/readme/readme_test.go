package readme

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/layers"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// program returns the README's Go program: the go block between the
// example-program markers.
func program(t *testing.T, readme string) string {
	t.Helper()
	_, rest, ok := strings.Cut(readme, "<!-- example-program -->")
	require.True(t, ok, "the README marks its program with <!-- example-program -->")
	block, _, ok := strings.Cut(rest, "<!-- /example-program -->")
	require.True(t, ok, "and ends it with <!-- /example-program -->")
	_, code, ok := strings.Cut(block, "```go\n")
	require.True(t, ok, "in a go block")
	code, _, ok = strings.Cut(code, "```")
	require.True(t, ok)
	return code
}

// The README's program, copied into a new module with a replace line, as
// the README says, defines a two-step saga with a compensation, starts it
// in its own pgx transaction and waits for it; it is under 60 lines.
func TestTheREADMEProgramRunsInAModuleOfItsOwn(t *testing.T) {
	t.Parallel()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH")
	}
	wd, err := os.Getwd()
	require.NoError(t, err)
	root, module, err := layers.ModuleRoot(wd)
	require.NoError(t, err)
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	require.NoError(t, err)
	code := program(t, string(readme))
	assert.Less(t, strings.Count(code, "\n"), 60, "the program is under 60 lines")

	dir := t.TempDir()
	gomod := "module example.com/shop\n\ngo 1.26\n\nrequire " + module + " v0.0.0\n\nreplace " + module + " => " + root + "\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644))
	sums, err := os.ReadFile(filepath.Join(root, "go.sum"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.sum"), sums, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(code), 0o644))

	db := testdb.Fresh(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, gobin, "run", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "DATABASE_URL="+db.URL, "GOFLAGS=-mod=mod")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "compensated ship: no courier\n", "the saga compensated its first step after the second failed")
}
