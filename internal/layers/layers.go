// Package layers states how pgsaga's packages depend on each other, and
// checks it: each package belongs to a layer, and a package imports only
// packages of lower layers or of its own layer's subtree (see Layers and
// Check). Its test reads the module's import graph (non-test files) and
// fails on an import that runs upward.
package layers

import (
	"fmt"
	"go/build"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
)

// Layer is a subtree of the module (Dir, relative to its root; a package
// belongs to the longest Dir that holds it) and its rank: a package may
// import packages of a lower rank, and packages of its own layer.
type Layer struct {
	Dir  string
	Rank int
	// TestOnly: its packages support tests; library packages (all but
	// cmd/ and other test support) must not import them.
	TestOnly bool
	// Sample: its packages are the sample, written as a user of the
	// module would write them: of internal/, they import only SampleMay.
	Sample bool
}

// SampleMay is what the sample imports of internal/: helpers a user would
// find elsewhere (pgerrcode's classes, a table check, goose with an
// advisory lock), nothing of delivery.
var SampleMay = []string{"internal/pgerr", "internal/sqlcheck", "internal/pgmigrate"}

// Layers is pgsaga's layout, bottom up (docs/DESIGN.md §2).
var Layers = []Layer{
	{Dir: "saga/delivery", Rank: 0}, // what users touch of delivery: types and errors every package shares
	{Dir: "internal", Rank: 1},      // plumbing: the pool, SQLSTATEs, metadata keys, outcomes
	{Dir: "internal/testout", Rank: 1, TestOnly: true},
	{Dir: "internal/testnats", Rank: 1, TestOnly: true},
	{Dir: "internal/testkafka", Rank: 1, TestOnly: true},
	{Dir: "migrations", Rank: 2},                        // the schema
	{Dir: "internal/testdb", Rank: 3, TestOnly: true},   // migrated test databases
	{Dir: "internal/testlost", Rank: 4, TestOnly: true}, // lost connections, on testdb's
	{Dir: "internal/testpg", Rank: 4, TestOnly: true},   // testdb with the embedded server, for pgsaga's own tests
	{Dir: "idempotency", Rank: 3},
	{Dir: "steps/events", Rank: 3},
	{Dir: "internal/telemetry", Rank: 3},
	{Dir: "internal/transport", Rank: 4},
	{Dir: "steps/broker", Rank: 5},
	{Dir: "internal/stepsrt", Rank: 5}, // the step runtime's door, for the client
	{Dir: "steps", Rank: 6},
	{Dir: "internal/bridge", Rank: 6},        // a client's bridge to its broker (steps/broker.Config)
	{Dir: "saga", Rank: 7},                   // the engine
	{Dir: "orders", Rank: 7, Sample: true},   // the sample's domains: participants, beside the engine
	{Dir: "payments", Rank: 7, Sample: true}, //
	{Dir: "saga/sagatest", Rank: 8, TestOnly: true},
	{Dir: "internal/present", Rank: 8},                    // how the operator's tools show sagas
	{Dir: "saga/sagaui", Rank: 9},                         // the web view, an http.Handler
	{Dir: "internal/testsample", Rank: 8, TestOnly: true}, // the sample's tables in test databases
	{Dir: "saga/orderpayment", Rank: 8, Sample: true},     // the sample saga, over the engine and the domains
	{Dir: "cmd", Rank: 10},
	{Dir: "docs/examples", Rank: 10, Sample: true}, // programs of a user's, on the public API
}

// layerOf returns the layer of the package at dir (relative to the module
// root), and false if none holds it.
func layerOf(layers []Layer, dir string) (Layer, bool) {
	best, found := Layer{}, false
	for _, l := range layers {
		if (dir == l.Dir || strings.HasPrefix(dir, l.Dir+"/")) && (!found || len(l.Dir) > len(best.Dir)) {
			best, found = l, true
		}
	}
	return best, found
}

// Import is one import of the module's own: From imports To (directories
// relative to the module root).
type Import struct{ From, To string }

// Check returns what breaks the layering among imports: an import of a
// higher or equal rank from another layer, an import of test support by a
// library package, and a package no layer holds.
func Check(layers []Layer, imports []Import) []string {
	var bad []string
	for _, im := range imports {
		from, okFrom := layerOf(layers, im.From)
		to, okTo := layerOf(layers, im.To)
		switch {
		case !okFrom:
			bad = append(bad, fmt.Sprintf("%s: in no layer", im.From))
		case !okTo:
			bad = append(bad, fmt.Sprintf("%s: in no layer", im.To))
		case from.Dir == to.Dir:
		case to.Rank >= from.Rank:
			bad = append(bad, fmt.Sprintf("%s (%s, rank %d) imports %s (%s, rank %d): upward", im.From, from.Dir, from.Rank, im.To, to.Dir, to.Rank))
		case to.TestOnly && !from.TestOnly && from.Dir != "cmd":
			bad = append(bad, fmt.Sprintf("%s imports %s, which supports tests only", im.From, im.To))
		case from.Sample && strings.HasPrefix(im.To, "internal/") && !slices.Contains(SampleMay, im.To):
			bad = append(bad, fmt.Sprintf("%s imports %s: the sample uses the public API", im.From, im.To))
		}
	}
	slices.Sort(bad)
	return slices.Compact(bad)
}

// Read returns the imports among the module's own packages, from their
// non-test files (build constraints as on this platform), for the module
// at root whose path is module.
func Read(root, module string) ([]Import, error) {
	var out []Import
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		name := d.Name()
		if p != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "vendor") {
			return filepath.SkipDir
		}
		pkg, err := build.Default.ImportDir(p, 0)
		if _, ok := err.(*build.NoGoError); ok {
			return nil
		}
		if err != nil {
			return fmt.Errorf("layers: reading %s: %w", p, err)
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		from := filepath.ToSlash(rel)
		for _, imp := range pkg.Imports {
			if to, ok := strings.CutPrefix(imp, module+"/"); ok {
				out = append(out, Import{From: from, To: path.Clean(to)})
			}
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool {
		if out[i].From != out[j].From {
			return out[i].From < out[j].From
		}
		return out[i].To < out[j].To
	})
	return out, err
}

// ModuleRoot returns the directory of the go.mod above dir, and its module
// path.
func ModuleRoot(dir string) (root, module string, err error) {
	for d := dir; ; d = filepath.Dir(d) {
		b, err := os.ReadFile(filepath.Join(d, "go.mod"))
		if err == nil {
			for _, line := range strings.Split(string(b), "\n") {
				if m, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
					return d, strings.TrimSpace(m), nil
				}
			}
			return "", "", fmt.Errorf("layers: %s/go.mod names no module", d)
		}
		if filepath.Dir(d) == d {
			return "", "", fmt.Errorf("layers: no go.mod above %s", dir)
		}
	}
}
