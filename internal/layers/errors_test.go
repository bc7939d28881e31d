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
	root, _ := thisModule(t)
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

// Every sentinel error of an internal package the library reaches (from a
// public package, directly or through other internal ones) is one users
// can name: a public package's value (delivery's, say, or the standard
// library's), or re-exported by a public package, or documented as one
// that never reaches users ("It never reaches users: …", for the
// plumbing's own signals). The test kit, which reports through
// testing.TB, is not a way in.
func TestEveryInternalSentinelUsersCanReceiveIsPublic(t *testing.T) {
	t.Parallel()
	root, module := thisModule(t)
	imports, err := Read(root, module)
	require.NoError(t, err)
	reached := map[string]bool{}
	var walk func(from string)
	walk = func(from string) {
		for _, im := range imports {
			if im.From == from && !Public(im.To) && !reached[im.To] && !strings.HasPrefix(im.To, "cmd/") {
				reached[im.To] = true
				walk(im.To)
			}
		}
	}
	reexported := map[string]bool{} // "internal/pkg.ErrX" a public package names as its own
	for _, im := range imports {
		// The test kit reports what goes wrong through testing.TB, not
		// as errors a caller branches on: what only it reaches is left out.
		if Public(im.From) && !strings.HasPrefix(im.From, "cmd") && !strings.HasPrefix(im.From, "saga/sagatest") {
			walk(im.From)
			for _, name := range reexports(t, filepath.Join(root, im.From), module) {
				reexported[name] = true
			}
		}
	}
	require.True(t, reached["internal/transport"] && reached["internal/pgserver"], "the reached packages were found: %v", reached)
	checked := 0
	for dir := range reached {
		n, problems := internalSentinelProblems(t, filepath.Join(root, dir), module, dir, reexported)
		checked += n
		assert.Empty(t, problems, "package %s", dir)
	}
	assert.GreaterOrEqual(t, checked, 25, "the internal sentinels were read")
}

// importNames maps the import names of f's imports to their paths.
func importNames(f *ast.File) map[string]string {
	out := map[string]string{}
	for _, imp := range f.Imports {
		path := strings.Trim(imp.Path.Value, `"`)
		name := filepath.Base(path)
		if imp.Name != nil {
			name = imp.Name.Name
		}
		out[name] = path
	}
	return out
}

// sentinels calls fn with each exported Err… variable of the package in
// dir, its value (nil if none), its doc and the imports of its file.
func sentinels(t *testing.T, dir string, fn func(name string, value ast.Expr, doc string, imports map[string]string)) {
	t.Helper()
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ParseComments)
	require.NoError(t, err)
	for _, p := range pkgs {
		for _, f := range p.Files {
			imports := importNames(f)
			for _, decl := range f.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.VAR {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					doc := vs.Doc
					if doc == nil && len(gd.Specs) == 1 {
						doc = gd.Doc
					}
					for i, name := range vs.Names {
						if !strings.HasPrefix(name.Name, "Err") || !name.IsExported() {
							continue
						}
						var value ast.Expr
						if i < len(vs.Values) {
							value = vs.Values[i]
						}
						fn(name.Name, value, doc.Text(), imports)
					}
				}
			}
		}
	}
}

// reexports lists the internal sentinels ("internal/pkg.ErrX") the public
// package in dir names as its own.
func reexports(t *testing.T, dir, module string) []string {
	t.Helper()
	var out []string
	sentinels(t, dir, func(_ string, value ast.Expr, _ string, imports map[string]string) {
		if s, ok := value.(*ast.SelectorExpr); ok {
			if x, ok := s.X.(*ast.Ident); ok {
				if rel, own := strings.CutPrefix(imports[x.Name], module+"/"); own && !Public(rel) {
					out = append(out, rel+"."+s.Sel.Name)
				}
			}
		}
	})
	return out
}

// internalSentinelProblems lists the sentinels of the internal package in
// dir (rel, relative to the module root) users could receive but cannot
// name, and how many it has.
func internalSentinelProblems(t *testing.T, dir, module, rel string, reexported map[string]bool) (int, []string) {
	t.Helper()
	var problems []string
	found := 0
	sentinels(t, dir, func(name string, value ast.Expr, doc string, imports map[string]string) {
		found++
		if s, ok := value.(*ast.SelectorExpr); ok {
			if x, ok := s.X.(*ast.Ident); ok {
				path := imports[x.Name]
				if p, own := strings.CutPrefix(path, module+"/"); (own && Public(p)) || (!own && !strings.Contains(path, ".")) {
					return // a public package's, or the standard library's
				}
			}
		}
		if reexported[rel+"."+name] || strings.Contains(strings.Join(strings.Fields(doc), " "), "It never reaches users: ") {
			return
		}
		problems = append(problems, name+" is a sentinel users can receive but not name: define it in a public package (delivery) and name that here")
	})
	return found, problems
}
