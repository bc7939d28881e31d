package layers

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every public package's exported sentinel errors (package-level Err…
// variables) live in its errors.go, each with a doc of its own that says
// when it is returned: "ErrX is returned when …" (or "is matched by", "is
// the reason" for an error carried in a type or a dead letter).
func TestSentinelsLiveInErrorsGoAndSayWhenTheyAreReturned(t *testing.T) {
	t.Parallel()
	wd, err := os.Getwd()
	require.NoError(t, err)
	root, _, err := ModuleRoot(wd)
	require.NoError(t, err)
	checked := 0
	require.NoError(t, filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		switch base := d.Name(); {
		case rel == "internal" || rel == "cmd" || base == "testdata" || strings.HasPrefix(base, "."):
			return filepath.SkipDir
		}
		if n, problems := sentinelProblems(t, path); n > 0 {
			checked++
			assert.Empty(t, problems, "package %s", rel)
		}
		return nil
	}))
	assert.GreaterOrEqual(t, checked, 8, "the public packages with sentinels were read")
}

// sentinelProblems lists what breaks the rule in the package in dir, and
// how many sentinels it has.
func sentinelProblems(t *testing.T, dir string) (int, []string) {
	t.Helper()
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ParseComments)
	require.NoError(t, err)
	var problems []string
	found := 0
	for _, p := range pkgs {
		for path, f := range p.Files {
			for _, decl := range f.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.VAR {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for _, name := range vs.Names {
						if !strings.HasPrefix(name.Name, "Err") || !name.IsExported() {
							continue
						}
						found++
						if filepath.Base(path) != "errors.go" {
							problems = append(problems, name.Name+" is declared in "+filepath.Base(path))
						}
						doc := vs.Doc
						if doc == nil && len(gd.Specs) == 1 {
							doc = gd.Doc
						}
						text := ""
						if doc != nil {
							text = doc.Text()
						}
						ok := false
						for _, form := range []string{" is returned ", " is matched by ", " is the reason "} {
							ok = ok || strings.HasPrefix(text, name.Name+form)
						}
						if !ok {
							problems = append(problems, name.Name+" has no doc of its own saying when it is returned: "+strings.SplitN(text, "\n", 2)[0])
						}
					}
				}
			}
		}
	}
	return found, problems
}

// The check finds a sentinel outside errors.go, and one without its own
// doc.
func TestSentinelCheckFindsStrayAndUndocumentedErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "errors.go"), []byte(`package p

import "errors"

// ErrGood is returned when all is well.
var ErrGood = errors.New("good")

var (
	ErrBare = errors.New("bare")
)
`), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "other.go"), []byte(`package p

import "errors"

// ErrStray is returned when it is in the wrong file.
var ErrStray = errors.New("stray")
`), 0o644))
	n, problems := sentinelProblems(t, dir)
	assert.Equal(t, 3, n)
	assert.Len(t, problems, 2, "%v", problems)
	assert.Contains(t, strings.Join(problems, "\n"), "ErrStray is declared in other.go")
	assert.Contains(t, strings.Join(problems, "\n"), "ErrBare has no doc")
}
