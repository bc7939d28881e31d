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
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) { testpg.Main(m) }

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
	gobin, root := goAndRoot(t)
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	require.NoError(t, err)
	code := program(t, string(readme))
	assert.Less(t, strings.Count(code, "\n"), 60, "the program is under 60 lines")
	dir := userModule(t, map[string]string{"main.go": code})

	db := testdb.Fresh(t)
	out := runGo(t, gobin, dir, []string{"DATABASE_URL=" + db.URL}, "run", ".")
	assert.Contains(t, string(out), "compensated ship: no courier\n", "the saga compensated its first step after the second failed")
}

// The README's set-up lines, run as they are in a fresh module next to a
// checkout (../pgsaga) that holds the README's program, give a module
// that builds and vets without any flag: what a user who copies them gets.
func TestTheREADMESetUpLinesWork(t *testing.T) {
	t.Parallel()
	gobin, root := goAndRoot(t)
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	require.NoError(t, err)
	_, rest, ok := strings.Cut(string(readme), "<!-- setup -->")
	require.True(t, ok, "the README marks its set-up lines with <!-- setup -->")
	block, _, ok := strings.Cut(rest, "<!-- /setup -->")
	require.True(t, ok)
	_, lines, ok := strings.Cut(block, "```sh\n")
	require.True(t, ok, "in a sh block")
	lines, _, _ = strings.Cut(lines, "```")

	dir := t.TempDir()
	require.NoError(t, os.Symlink(root, filepath.Join(dir, "pgsaga")))
	shop := filepath.Join(dir, "shop")
	require.NoError(t, os.Mkdir(shop, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(shop, "main.go"), []byte(program(t, string(readme))), 0o644))
	plain := []string{"GOFLAGS=-buildvcs=false"} // no -mod=mod: as a user's shell has it
	runGo(t, gobin, shop, plain, "mod", "init", "example.com/shop")
	n := 0
	for line := range strings.Lines(lines) {
		args := strings.Fields(line)
		if len(args) == 0 {
			continue
		}
		require.Equal(t, "go", args[0], "a set-up line is a go command: %q", line)
		runGo(t, gobin, shop, plain, args[1:]...)
		n++
	}
	assert.Positive(t, n, "set-up lines ran")
	runGo(t, gobin, shop, plain, "vet", ".")
}

// userProgram uses what a user of the module touches beyond the README's
// program, from a module of its own: delivery settings, metrics, an
// interceptor, a step that awaits a call, a projection, the idempotency
// store, the operator calls, and the test kit. It is built and vetted, not
// run: every name in it must be usable outside the module (none may need
// an internal package to be written).
const userProgram = `package main

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
	"github.com/pgsaga/pgsaga/steps/events"
)

type Charge struct{ ID string }

func (Charge) MessageType() string { return "shop.Charge" }

func charge(ctx context.Context, tx *steps.Tx, c Charge) (steps.Message, error) {
	if steps.Awaited(ctx) {
		return nil, nil
	}
	if c.ID == "" {
		return nil, steps.Permanent(errors.New("no id"))
	}
	return nil, steps.Await(time.Second, func(ctx context.Context) error { return nil })
}

func project(ctx context.Context, tx delivery.DBTX, msg *message.Message) error {
	_, err := tx.ExecContext(ctx, "SELECT 1")
	return err
}

func build(ctx context.Context, client *saga.Client, store *idempotency.Store) error {
	if err := client.AddSteps(steps.Define("shop.charge", "shop.charge", charge)); err != nil {
		return err
	}
	if err := client.AddProjections(events.Projection{Name: "view", Topic: "shop.events", Handle: project}); err != nil {
		return err
	}
	for _, s := range client.Subscriptions() {
		_, _ = s.Topic, s.ConsumerGroup
	}
	if _, err := store.Do(ctx, idempotency.Request{Scope: "api", Key: "k"}, func(ctx context.Context, tx delivery.DBTX) (idempotency.Response, error) {
		return idempotency.Response{}, &idempotency.Failure{Reason: "no"}
	}); err != nil {
		return err
	}
	letters, err := client.DeadLetters(ctx, delivery.DeadLetterFilter{Limit: 10})
	for _, d := range letters {
		_, _ = client.ReplayDeadLetter(ctx, d.ID)
	}
	groups, err := client.ConsumerGroups(ctx)
	for _, g := range groups {
		_, err = client.DropConsumerGroups(ctx, delivery.GroupDrop{ConsumerGroup: g.ConsumerGroup, UnlessSeenWithin: time.Minute})
		var alive *delivery.ConsumerGroupAliveError
		_ = errors.As(err, &alive) || errors.Is(err, delivery.ErrConsumerGroupAlive)
	}
	_, err = client.List(ctx, saga.Filter{Statuses: []saga.Status{saga.StatusFailed}})
	return err
}

func main() {
	cfg := saga.ClientConfig{
		Transport: delivery.Config{BatchSize: 10, Metrics: prometheus.NewRegistry(),
			Intercept: func(handler string, h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc { return h }},
		Retry: &delivery.RetryPolicy{MaxAttempts: 3},
	}
	client, err := saga.NewClientFromDB(nil, cfg)
	if err == nil {
		_ = build(context.Background(), client, nil)
	}
}
`

// userTest is the test kit, used from that module's tests.
const userTest = `package main

import (
	"context"
	"database/sql"
	"testing"
	"testing/fstest"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps"
)

func TestMain(m *testing.M) {
	sagatest.Main(m, sagatest.Schema{Files: fstest.MapFS{}, Migrate: func(context.Context, *sql.DB) ([]int64, error) { return nil, nil }})
}

func TestCharge(t *testing.T) {
	db := sagatest.DB(t)
	run := sagatest.New(t, db.SQL, sagatest.Faults{Seed: 1})
	client, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Transport: delivery.Config{Intercept: run.Intercept}, Logger: sagatest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	step := steps.Define("shop.charge", "shop.charge", charge)
	res := sagatest.Step(t, client, step, Charge{ID: "c"}, func(tx delivery.DBTX) error { return nil })
	_, _ = res.Failed(), res.Err
	tr := sagatest.Transitions(t, client, "order", Charge{ID: "c"}, nil, sagatest.Answer(nil), sagatest.Refuse(nil, "no"))
	_ = tr.Last().Instance.Status
}
`

// Every name a user touches is usable from a module of its own: the
// program and its test above build and pass go vet there, with a replace
// line. (An exported name whose type is internal fails this: a field of
// an internal named type cannot be set, nor an internal type written.)
func TestThePublicSurfaceServesAModuleOfItsOwn(t *testing.T) {
	t.Parallel()
	gobin, _ := goAndRoot(t)
	dir := userModule(t, map[string]string{"main.go": userProgram, "main_test.go": userTest})
	runGo(t, gobin, dir, nil, "vet", ".")
}

// runGo runs the go tool in dir and returns what it printed, failing the
// test if it fails. On a cold build cache, building a module of its own
// (the whole of pgsaga and its dependencies, without -race) takes minutes
// on a small machine: it may take until shortly before the test binary's
// own deadline (go test -timeout), and a run cut off says so rather than
// "signal: killed".
func runGo(t *testing.T, gobin, dir string, env []string, args ...string) string {
	t.Helper()
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if deadline, ok := t.Deadline(); ok {
		ctx, cancel = context.WithDeadline(ctx, deadline.Add(-20*time.Second))
	}
	defer cancel()
	cmd := exec.CommandContext(ctx, gobin, args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "GOFLAGS=-mod=mod"), env...)
	began := time.Now()
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("gave up on `go %s` in a module of its own after %s, near the test binary's deadline: building pgsaga and its "+
			"dependencies on a cold build cache takes that long here; run again (the cache is warm now) or raise go test -timeout.\n%s",
			strings.Join(args, " "), time.Since(began).Round(time.Second), out)
	}
	require.NoError(t, err, "go %s: %s", strings.Join(args, " "), out)
	return string(out)
}

// goAndRoot returns the go tool (the test is skipped without one) and the
// module's root.
func goAndRoot(t *testing.T) (gobin, root string) {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH")
	}
	wd, err := os.Getwd()
	require.NoError(t, err)
	root, _, err = layers.ModuleRoot(wd)
	require.NoError(t, err)
	return gobin, root
}

// userModule writes files into a new module outside the repository that
// requires this one through a replace line, as the README says a user's
// module does, and returns its directory.
func userModule(t *testing.T, files map[string]string) string {
	t.Helper()
	wd, err := os.Getwd()
	require.NoError(t, err)
	root, module, err := layers.ModuleRoot(wd)
	require.NoError(t, err)
	dir := t.TempDir()
	files["go.mod"] = "module example.com/shop\n\ngo 1.26\n\nrequire " + module + " v0.0.0\n\nreplace " + module + " => " + root + "\n"
	sums, err := os.ReadFile(filepath.Join(root, "go.sum"))
	require.NoError(t, err)
	files["go.sum"] = string(sums)
	for name, text := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644))
	}
	return dir
}
