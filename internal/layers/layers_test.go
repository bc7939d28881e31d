package layers

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every import among the module's packages runs downward (Layers).
func TestImportsRunDownward(t *testing.T) {
	t.Parallel()
	root, module := thisModule(t)
	imports, err := Read(root, module)
	require.NoError(t, err)
	require.Greater(t, len(imports), 50, "the module's imports were read")
	assert.Contains(t, imports, Import{From: "saga", To: "steps"}, "an import known to exist was read")
	assert.Empty(t, Check(Layers, imports))
}

// The check itself: each way an import can break the layering is reported.
func TestCheckReportsWhatRunsUpward(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		imp  Import
		want string
	}{
		"a domain importing the engine":     {Import{"orders", "saga"}, "orders (orders, rank 7) imports saga (saga, rank 7): upward"},
		"a store importing the steps":       {Import{"idempotency", "steps"}, "idempotency (idempotency, rank 3) imports steps (steps, rank 6): upward"},
		"plumbing importing the sample":     {Import{"internal/pgdb", "saga/orderpayment"}, "internal/pgdb (internal, rank 1) imports saga/orderpayment (saga/orderpayment, rank 8): upward"},
		"the sample importing the test kit": {Import{"saga/orderpayment", "saga/sagatest"}, "saga/orderpayment (saga/orderpayment, rank 8) imports saga/sagatest (saga/sagatest, rank 8): upward"},
		"a library importing test support":  {Import{"saga", "internal/testout"}, "saga imports internal/testout, which supports tests only"},
		"a package in no layer":             {Import{"tools/x", "internal/pgdb"}, "tools/x: in no layer"},
		"the sample reaching past the API":  {Import{"orders", "internal/transport"}, "orders imports internal/transport: the sample uses the public API"},
	} {
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, []string{tc.want}, Check(Layers, []Import{tc.imp}))
		})
	}
	assert.Empty(t, Check(Layers, []Import{
		{"saga/orderpayment", "orders"}, {"saga", "internal/transport"}, {"internal/transport", "internal/dbtx"},
		{"cmd/orderdemo", "cmd/internal/workerwatch"}, {"cmd/orderdemo", "saga/sagatest"}, {"internal/testdb", "migrations"},
		{"steps/broker/natsjs", "steps/broker"}, {"payments", "internal/pgerr"},
	}), "downward and same-layer imports pass")
}

// The advisory lock keys the module's code takes (0x706773616761…,
// "pgsaga" and a number) are distinct: two owners of one key would wait
// on each other (the payments migrations and the test template builds
// once did, on one database).
func TestAdvisoryLockKeysAreDistinct(t *testing.T) {
	t.Parallel()
	root, _ := thisModule(t)
	key := regexp.MustCompile(`0x706773616761[0-9a-fA-F]{4}`)
	owners := map[string][]string{}
	require.NoError(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && p != root {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		for _, k := range key.FindAllString(string(b), -1) {
			owners[strings.ToLower(k)] = append(owners[strings.ToLower(k)], rel)
		}
		return nil
	}))
	require.GreaterOrEqual(t, len(owners), 5, "the keys were found: %v", owners)
	for k, files := range owners {
		assert.Len(t, files, 1, "advisory lock key %s is taken in %v", k, files)
	}
}

// thisModule returns the root directory and path of the module under test.
func thisModule(t *testing.T) (root, module string) {
	t.Helper()
	wd, err := os.Getwd()
	require.NoError(t, err)
	root, module, err = ModuleRoot(wd)
	require.NoError(t, err)
	return root, module
}
