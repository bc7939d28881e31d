package layers

import (
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// No public name is an alias of an internal type, and no exported
// signature, field, variable or constant of a public package names one:
// what users touch is documented where they can read it (go doc), and a
// change inside internal/ cannot change the API unseen.
func TestThePublicAPINamesNoInternalType(t *testing.T) {
	t.Parallel()
	root, module := thisModule(t)
	leaks, err := Leaks(root, module)
	require.NoError(t, err)
	assert.Empty(t, leaks, "the public API reaches into internal/:\n%s", strings.Join(leaks, "\n"))
}

// The check itself finds each way a public package can reach into
// internal/: an alias, a field, a parameter, a result, a method, an
// interface's method, a variable, a constant, a type argument.
func TestLeaksFindsEachWayIntoInternal(t *testing.T) {
	t.Parallel()
	const module = "example.com/m"
	fset := token.NewFileSet()
	parse := func(name, src string) *ast.File {
		f, err := parser.ParseFile(fset, name, src, 0)
		require.NoError(t, err)
		return f
	}
	internal, err := (&types.Config{}).Check(module+"/internal/in", fset, []*ast.File{parse("in.go", `package in
type T struct{}
type K int
const KA K = 1
`)}, nil)
	require.NoError(t, err)
	imp := importerFunc(func(path string) (*types.Package, error) {
		if path == internal.Path() {
			return internal, nil
		}
		return importer.Default().Import(path)
	})
	pub, err := (&types.Config{Importer: imp}).Check(module+"/pub", fset, []*ast.File{parse("pub.go", `package pub
import "example.com/m/internal/in"
type Alias = in.T
type S struct { F *in.T; ok int; in.K }
func Param(x in.T) {}
func Result() []in.T { return nil }
type M struct{}
func (M) Method() map[string]in.K { return nil }
type I interface { Do(func(in.T)) }
var V in.T
const C = in.KA
type G[X any] struct{}
var GV G[in.T]
type Fine struct{ A int; b in.T }
func (Fine) unexported(in.T) {}
func Clean(s string) error { return nil }
`)}, nil)
	require.NoError(t, err)
	leaks := PackageLeaks(pub, module)
	assert.ElementsMatch(t, []string{
		"pub.Alias is an alias of internal/in.T",
		"pub.S.F names internal/in.T",
		"pub.S.K names internal/in.K",
		"pub.Param names internal/in.T",
		"pub.Result names internal/in.T",
		"pub.M.Method names internal/in.K",
		"pub.I.Do names internal/in.T",
		"pub.V names internal/in.T",
		"pub.C names internal/in.K",
		"pub.GV names internal/in.T",
	}, leaks)
}

type importerFunc func(path string) (*types.Package, error)

func (f importerFunc) Import(path string) (*types.Package, error) { return f(path) }

// The library exports at most 400 package-level names (types, functions,
// variables, constants; the test kit included, the sample's packages not:
// they are an application written over the library). The counts per
// package, with and without methods, are logged for the notes that track
// them.
func TestTheLibraryExportsAtMost400Names(t *testing.T) {
	t.Parallel()
	root, module := thisModule(t)
	names, err := Names(root, module)
	require.NoError(t, err)
	withMethods, err := Exports(root, module)
	require.NoError(t, err)
	require.Contains(t, names, "saga", "the packages were read")
	library, all, lines := 0, 0, []string{}
	for pkg, n := range names {
		all += n
		sample := ""
		if l, ok := layerOf(Layers, pkg); ok && l.Sample {
			sample = " (sample)"
		} else {
			library += n
		}
		lines = append(lines, fmt.Sprintf("%4d %4d %s%s", n, withMethods[pkg], pkg, sample))
	}
	slices.Sort(lines)
	t.Logf("exported names (and with methods) by package; the library %d, with the sample %d:\n%s", library, all, strings.Join(lines, "\n"))
	assert.LessOrEqual(t, library, 400)
}

// The public packages, the test kit first among them, build without the
// heavy test machinery: the embedded PostgreSQL and the lib/pq driver it
// brings, and the network proxy. A user's test build gets each only by
// importing the one package whose point it is: saga/sagatest/embeddedpg,
// saga/sagatest/netfault.
func TestThePublicPackagesPullNoEmbeddedServer(t *testing.T) {
	t.Parallel()
	root, module := thisModule(t)
	heavy := map[string]string{ // dependency → the one public package that may pull it
		"github.com/fergusstrange/embedded-postgres": module + "/saga/sagatest/embeddedpg",
		"github.com/lib/pq":                          module + "/saga/sagatest/embeddedpg",
		"github.com/Shopify/toxiproxy/v2":            module + "/saga/sagatest/netfault",
	}
	deps := func(pkg string) []string {
		out, err := exec.Command("go", "list", "-C", root, "-deps", "-f", "{{.ImportPath}}", pkg).Output()
		require.NoError(t, err, "go list -deps %s", pkg)
		return strings.Fields(string(out))
	}
	var pulled []string
	for _, pkg := range publicPackages(t, root, module) {
		for _, dep := range deps(pkg) {
			if owner, ok := heavy[dep]; ok && owner != pkg {
				pulled = append(pulled, pkg+" pulls "+dep)
			}
		}
	}
	assert.Empty(t, pulled)
	for dep, owner := range heavy {
		assert.Contains(t, deps(owner), dep, "the check looks for what %s imports", owner)
	}
}

// publicPackages lists the module's public packages (Public, not main).
func publicPackages(t *testing.T, root, module string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-C", root, "-f", "{{.ImportPath}} {{.Name}}", "./...").Output()
	require.NoError(t, err)
	var pkgs []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		path, name, _ := strings.Cut(line, " ")
		if rel, ok := strings.CutPrefix(path, module+"/"); ok && name != "main" && Public(rel) {
			pkgs = append(pkgs, path)
		}
	}
	require.NotEmpty(t, pkgs)
	return pkgs
}
