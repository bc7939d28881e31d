package layers

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/importer"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
)

// Public reports whether the module package at dir (relative to the
// module root) is part of the public API: not under internal/ or cmd/.
func Public(dir string) bool {
	for _, part := range strings.Split(dir, "/") {
		if part == "internal" {
			return false
		}
	}
	return dir != "cmd" && !strings.HasPrefix(dir, "cmd/")
}

// Leaks returns where the public API of the module at root (whose path is
// module) reaches into internal/: an exported name that is an alias of an
// internal type, and an exported signature, field, variable or constant
// whose type names one. It reads the packages' export data through
// `go list -export`, so it sees the API as the compiler does.
func Leaks(root, module string) ([]string, error) {
	exports, public, err := listExports(root, module)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("layers: no export data for %s", path)
		}
		return os.Open(file)
	})
	var leaks []string
	for _, path := range public {
		pkg, err := imp.Import(path)
		if err != nil {
			return nil, fmt.Errorf("layers: importing %s: %w", path, err)
		}
		leaks = append(leaks, PackageLeaks(pkg, module)...)
	}
	slices.Sort(leaks)
	return slices.Compact(leaks), nil
}

// listExports returns the export data file of every package the module's
// packages build from, and the module's public packages (not main).
func listExports(root, module string) (map[string]string, []string, error) {
	cmd := exec.Command("go", "list", "-e", "-export", "-deps", "-json=ImportPath,Export,Name,Module,Error", "./...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, nil, fmt.Errorf("layers: go list: %w: %s", err, stderr.String())
	}
	exports := map[string]string{}
	var public []string
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath, Export, Name string
			Module                   *struct{ Path string }
			Error                    *struct{ Err string }
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, nil, fmt.Errorf("layers: reading go list: %w", err)
		}
		if p.Error != nil {
			return nil, nil, fmt.Errorf("layers: %s: %s", p.ImportPath, p.Error.Err)
		}
		if p.Export == "" {
			continue // nothing compiled: a package of test files only
		}
		exports[p.ImportPath] = p.Export
		rel, own := strings.CutPrefix(p.ImportPath, module+"/")
		if own && p.Module != nil && p.Module.Path == module && p.Name != "main" && Public(rel) {
			public = append(public, p.ImportPath)
		}
	}
	slices.Sort(public)
	return exports, public, nil
}

// PackageLeaks returns where pkg's exported API names a type of an
// internal package of module.
func PackageLeaks(pkg *types.Package, module string) []string {
	w := &surfaceWalker{module: module, pkg: pkg}
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		where := shortPath(pkg.Path(), module) + "." + name
		tn, isType := obj.(*types.TypeName)
		if !isType {
			w.walk(obj.Type(), where)
			continue
		}
		if alias, ok := obj.Type().(*types.Alias); ok {
			if target := internalNamed(types.Unalias(alias), module); target != "" {
				w.report(where, "is an alias of "+target)
				continue
			}
			w.walk(alias.Rhs(), where)
			continue
		}
		named, ok := tn.Type().(*types.Named)
		if !ok {
			continue
		}
		if tps := named.TypeParams(); tps != nil {
			for i := range tps.Len() {
				w.walk(tps.At(i).Constraint(), where)
			}
		}
		w.walkUnderlying(named.Underlying(), where)
		for i := range named.NumMethods() {
			m := named.Method(i)
			if m.Exported() {
				w.walk(m.Type(), where+"."+m.Name())
			}
		}
	}
	return w.leaks
}

type surfaceWalker struct {
	module string
	pkg    *types.Package
	leaks  []string
}

func (w *surfaceWalker) report(where, what string) {
	w.leaks = append(w.leaks, where+" "+what)
}

// internalNamed returns the name of t if it is a named type (or an alias)
// declared in an internal package of module, else "".
func internalNamed(t types.Type, module string) string {
	var obj *types.TypeName
	switch t := t.(type) {
	case *types.Named:
		obj = t.Obj()
	case *types.Alias:
		obj = t.Obj()
	default:
		return ""
	}
	if obj.Pkg() == nil {
		return ""
	}
	rel, own := strings.CutPrefix(obj.Pkg().Path(), module+"/")
	if !own || Public(rel) {
		return ""
	}
	return rel + "." + obj.Name()
}

// walkUnderlying walks a declared type's structure: exported fields of a
// struct (and embedded ones, whose fields are promoted), an interface's
// methods.
func (w *surfaceWalker) walkUnderlying(t types.Type, where string) {
	switch t := t.(type) {
	case *types.Struct:
		for i := range t.NumFields() {
			f := t.Field(i)
			if f.Exported() || f.Embedded() {
				w.walk(f.Type(), where+"."+f.Name())
			}
		}
	case *types.Interface:
		for i := range t.NumExplicitMethods() {
			m := t.ExplicitMethod(i)
			if m.Exported() {
				w.walk(m.Type(), where+"."+m.Name())
			}
		}
		for i := range t.NumEmbeddeds() {
			w.walk(t.EmbeddedType(i), where)
		}
	default:
		w.walk(t, where)
	}
}

// walk reports an internal type anywhere in t. It stops at named types of
// other packages (the public ones are checked on their own) but looks at
// their type arguments.
func (w *surfaceWalker) walk(t types.Type, where string) {
	if t == nil {
		return
	}
	if name := internalNamed(t, w.module); name != "" {
		w.report(where, "names "+name)
		return
	}
	switch t := t.(type) {
	case *types.Alias:
		if args := t.TypeArgs(); args != nil {
			for i := range args.Len() {
				w.walk(args.At(i), where)
			}
		}
		w.walk(types.Unalias(t), where)
	case *types.Named:
		if args := t.TypeArgs(); args != nil {
			for i := range args.Len() {
				w.walk(args.At(i), where)
			}
		}
		if t.Obj().Pkg() == w.pkg && t.Obj().Parent() != w.pkg.Scope() && t.TypeArgs() == nil {
			// a type local to a function: not reachable by name
			w.walkUnderlying(t.Underlying(), where)
		}
	case *types.Pointer:
		w.walk(t.Elem(), where)
	case *types.Slice:
		w.walk(t.Elem(), where)
	case *types.Array:
		w.walk(t.Elem(), where)
	case *types.Map:
		w.walk(t.Key(), where)
		w.walk(t.Elem(), where)
	case *types.Chan:
		w.walk(t.Elem(), where)
	case *types.Signature:
		if tps := t.TypeParams(); tps != nil {
			for i := range tps.Len() {
				w.walk(tps.At(i).Constraint(), where)
			}
		}
		for i := range t.Params().Len() {
			w.walk(t.Params().At(i).Type(), where)
		}
		for i := range t.Results().Len() {
			w.walk(t.Results().At(i).Type(), where)
		}
	case *types.Struct, *types.Interface:
		w.walkUnderlying(t, where)
	case *types.Union:
		for i := range t.Len() {
			w.walk(t.Term(i).Type(), where)
		}
	case *types.TypeParam:
	}
}

func shortPath(path, module string) string {
	if rel, ok := strings.CutPrefix(path, module+"/"); ok {
		return rel
	}
	return path
}

// Exports counts the exported identifiers of each public package of the
// module at root: its package-level names (types, functions, variables,
// constants) and the exported methods of its exported types, as go doc
// lists them.
func Exports(root, module string) (map[string]int, error) { return countExports(root, module, true) }

// Names counts the package-level exported names of each public package,
// without methods.
func Names(root, module string) (map[string]int, error) { return countExports(root, module, false) }

func countExports(root, module string, methods bool) (map[string]int, error) {
	exports, public, err := listExports(root, module)
	if err != nil {
		return nil, err
	}
	imp := importer.ForCompiler(token.NewFileSet(), "gc", func(path string) (io.ReadCloser, error) {
		return os.Open(exports[path])
	})
	out := map[string]int{}
	for _, path := range public {
		pkg, err := imp.Import(path)
		if err != nil {
			return nil, fmt.Errorf("layers: importing %s: %w", path, err)
		}
		n := 0
		scope := pkg.Scope()
		for _, name := range scope.Names() {
			obj := scope.Lookup(name)
			if !obj.Exported() {
				continue
			}
			n++
			if tn, ok := obj.(*types.TypeName); ok && methods && !tn.IsAlias() {
				if named, ok := tn.Type().(*types.Named); ok {
					for i := range named.NumMethods() {
						if named.Method(i).Exported() {
							n++
						}
					}
				}
			}
		}
		out[shortPath(path, module)] = n
	}
	return out, nil
}
