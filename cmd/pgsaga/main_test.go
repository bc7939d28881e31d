package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/internal/testsample"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

func TestMain(m *testing.M) {
	// The test binary is also the program, for the tests that signal it.
	if args := os.Getenv(childArgs); args != "" {
		os.Exit(runMain(strings.Fields(args)))
	}
	testpg.Main(m, testsample.Schemas()...)
}

// sampleRun runs the sample saga on a fresh database for two orders, one
// paid (completed) and one the customer cannot pay (compensated), and
// puts one message on a topic nobody reads (a dead letter). It points
// DATABASE_URL at that database.
func sampleRun(t *testing.T) (paid, unpaid uuid.UUID) {
	t.Helper()
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	return sampleRunOn(t, db)
}

// sampleRunOn is sampleRun on db.
func sampleRunOn(t *testing.T, db *testdb.DB) (paid, unpaid uuid.UUID) {
	t.Helper()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	gw, err := fakegateway.Start(context.Background(), fakegateway.Config{DB: db.SQL, Logger: quiet})
	require.NoError(t, err)
	t.Cleanup(func() { _ = gw.Close() })
	app, err := orderpayment.New(orderpayment.Config{DB: db.SQL, GatewayURL: gw.URL(), Logger: quiet,
		Transport: transport.Config{IdlePollInterval: testdb.NoSafetyPoll}})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, app.Setup(ctx))
	w, err := app.NewWorker()
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx))
	t.Cleanup(func() { _ = w.Stop() })
	place := func(customer string, balance int64) uuid.UUID {
		require.NoError(t, app.Orders.AddCustomer(ctx, customer, customer))
		require.NoError(t, app.Payments.OpenAccount(ctx, customer))
		if balance > 0 {
			require.NoError(t, app.Payments.Deposit(ctx, customer, balance, "seed"))
		}
		res, err := app.Orders.Place(ctx, orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customer, AmountCents: 500})
		require.NoError(t, err)
		return saga.ID(orderpayment.Name, res.OrderID.String())
	}
	paid, unpaid = place("alice", 1000), place("bob", 0)
	deadline := time.Now().Add(30 * time.Second)
	for _, id := range []uuid.UUID{paid, unpaid} {
		for {
			in, err := app.Client.Get(ctx, id)
			if err == nil && in.Status.Terminal() {
				break
			}
			require.True(t, time.Now().Before(deadline), "saga %s did not finish", id)
			time.Sleep(20 * time.Millisecond)
		}
	}
	tr, err := transport.New(transport.Config{DB: db.SQL})
	require.NoError(t, err)
	require.NoError(t, tr.Publisher(db.SQL).Publish("nobody.reads", message.NewMessage(uuid.NewString(), []byte("lost"))))
	// A group that was set up and never ran, with a message waiting.
	require.NoError(t, tr.Subscribe(ctx, transport.Subscription{Topic: "old.topic", ConsumerGroup: "old-group"}))
	require.NoError(t, tr.Publisher(db.SQL).Publish("old.topic", message.NewMessage(uuid.NewString(), []byte("waits"))))
	return paid, unpaid
}

func pgsaga(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// The contract of each subcommand on a database filled by a real run: the
// listings (text and --json), the timeline of one saga, the schema version,
// the dead letters; exit 1 for what fails, 2 for a bad command line.
func TestSubcommandsOnARealRun(t *testing.T) {
	paid, unpaid := sampleRun(t)

	code, out, errOut := pgsaga(t, "sagas", "--json")
	require.Equal(t, exitOK, code, errOut)
	var list []sagaJSON
	require.NoError(t, json.Unmarshal([]byte(out), &list))
	require.Len(t, list, 2)
	byID := map[string]sagaJSON{}
	for _, s := range list {
		byID[s.ID] = s
	}
	assert.Equal(t, "completed", byID[paid.String()].Status)
	assert.Equal(t, "compensated", byID[unpaid.String()].Status)
	assert.Equal(t, orderpayment.Name, byID[paid.String()].Saga)
	assert.NotEmpty(t, byID[paid.String()].Step, "the step is named from the timeline, without the definition")
	assert.NotContains(t, byID[paid.String()].Step, "#")

	code, out, _ = pgsaga(t, "sagas", "--status", "compensated", "--json")
	require.Equal(t, exitOK, code)
	require.NoError(t, json.Unmarshal([]byte(out), &list))
	require.Len(t, list, 1)
	assert.Equal(t, unpaid.String(), list[0].ID)

	code, out, _ = pgsaga(t, "sagas", "--older-than", "1h")
	require.Equal(t, exitOK, code)
	assert.NotContains(t, out, paid.String(), "both were updated just now")

	code, out, _ = pgsaga(t, "sagas")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "STATUS")
	assert.Contains(t, out, paid.String())

	code, out, _ = pgsaga(t, "show", unpaid.String())
	require.Equal(t, exitOK, code)
	for _, want := range []string{"compensated", "started", "sent", "reply_failed", "compensated"} {
		assert.Contains(t, out, want)
	}
	code, out, _ = pgsaga(t, "show", "--json", paid.String())
	require.Equal(t, exitOK, code)
	var shown sagaJSON
	require.NoError(t, json.Unmarshal([]byte(out), &shown))
	require.NotEmpty(t, shown.Timeline)
	assert.Equal(t, "started", shown.Timeline[0].Kind)
	assert.Equal(t, "completed", shown.Timeline[len(shown.Timeline)-1].Kind)

	code, out, _ = pgsaga(t, "dead-letters", "--json")
	require.Equal(t, exitOK, code)
	var dead []deadLetterJSON
	require.NoError(t, json.Unmarshal([]byte(out), &dead))
	require.Len(t, dead, 1)
	assert.Equal(t, "nobody.reads", dead[0].Topic)
	require.NotNil(t, dead[0].Payload)
	assert.Equal(t, "lost", *dead[0].Payload)
	assert.Nil(t, dead[0].ReplayedAt)
	id := strconv.FormatInt(dead[0].ID, 10)
	code, _, errOut = pgsaga(t, "dead-letters", "replay", id)
	assert.Equal(t, exitFailed, code, "no group reads nobody.reads")
	assert.Contains(t, errOut, "no consumer group")
	code, _, _ = pgsaga(t, "dead-letters", "replay", "x1")
	assert.Equal(t, exitUsage, code)
	db := sqlDB(t)
	_, err := db.Exec(`INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ('nobody.reads', 'late-reader')`)
	require.NoError(t, err)
	code, out, errOut = pgsaga(t, "dead-letters", "replay", id)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed (1 queue)")
	code, _, errOut = pgsaga(t, "dead-letters", "replay", id)
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "replayed already")
	code, out, _ = pgsaga(t, "dead-letters", "--json")
	require.Equal(t, exitOK, code)
	require.NoError(t, json.Unmarshal([]byte(out), &dead))
	require.Len(t, dead, 1)
	assert.NotNil(t, dead[0].ReplayedAt)
	assert.True(t, dead[0].Replayable)

	// What a broker bridge received but could not queue is listed as not
	// replayable, and its replay is refused with why.
	tr, err := transport.New(transport.Config{DB: db})
	require.NoError(t, err)
	require.NoError(t, tr.StoreDeadLetter(context.Background(), "payments.replies", "pgsaga", transport.ReceiveHandler,
		message.NewMessage("garbled", []byte("\xff")), "unreadable"))
	code, out, _ = pgsaga(t, "dead-letters", "--json", "--topic", "payments.replies")
	require.Equal(t, exitOK, code)
	require.NoError(t, json.Unmarshal([]byte(out), &dead))
	require.Len(t, dead, 1)
	assert.False(t, dead[0].Replayable)
	code, out, _ = pgsaga(t, "dead-letters", "--topic", "payments.replies")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "cannot")
	code, _, errOut = pgsaga(t, "dead-letters", "replay", strconv.FormatInt(dead[0].ID, 10))
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "must be sent again")

	code, out, _ = pgsaga(t, "consumers", "--json")
	require.Equal(t, exitOK, code)
	var groups []groupJSON
	require.NoError(t, json.Unmarshal([]byte(out), &groups))
	byGroup := map[string]groupJSON{}
	for _, g := range groups {
		byGroup[g.Topic+"/"+g.ConsumerGroup] = g
	}
	charge := byGroup["payments.charge/payments.charge"]
	assert.True(t, charge.Running, "the worker runs the charge: %+v", charge)
	assert.Zero(t, charge.Waiting)
	old := byGroup["old.topic/old-group"]
	assert.False(t, old.Running)
	assert.Nil(t, old.LastSeenAt)
	assert.Equal(t, 1, old.Waiting)
	require.NotNil(t, old.OldestAgeS)
	code, out, _ = pgsaga(t, "consumers")
	require.Equal(t, exitOK, code)
	assert.Regexp(t, `old\.topic\s+old-group\s+1\s+0\s+0\s+\S+\s+never\s+NO`, out)

	code, _, errOut = pgsaga(t, "consumers", "drop", "old-group")
	assert.Equal(t, exitUsage, code, "without --yes nothing is dropped")
	assert.Contains(t, errOut, "deletes the 1 messages waiting")
	code, _, errOut = pgsaga(t, "consumers", "drop", "no-such-group", "--yes")
	assert.Equal(t, exitFailed, code, errOut)
	code, out, errOut = pgsaga(t, "consumers", "drop", "old-group", "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "1 messages deleted")
	code, out, _ = pgsaga(t, "consumers", "--json")
	require.Equal(t, exitOK, code)
	assert.NotContains(t, out, "old-group")

	code, out, _ = pgsaga(t, "version", "--json")
	require.Equal(t, exitOK, code)
	var v versionJSON
	require.NoError(t, json.Unmarshal([]byte(out), &v))
	assert.True(t, v.UpToDate)
	assert.Positive(t, v.SchemaVersion)
	code, out, _ = pgsaga(t, "migrate")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "up to date")

	// What fails: exit 1, one line saying why.
	code, _, errOut = pgsaga(t, "show", uuid.NewString())
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "not found")
	// A bad command line: exit 2.
	for _, args := range [][]string{
		{"show", "not-a-uuid"}, {"show"}, {"sagas", "--status", "bogus"}, {"sagas", "--limit", "0"},
		{"sagas", "--no-such-flag"}, {"no-such-command"}, {"sagas", "extra"},
	} {
		code, _, errOut = pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
}

// With no database to read it fails with one line naming the way out, and
// starts none.
func TestNoDatabase(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/pgsaga?sslmode=disable&connect_timeout=2")
	code, _, errOut := pgsaga(t, "sagas")
	assert.Equal(t, exitFailed, code)
	assert.Equal(t, 1, strings.Count(strings.TrimSpace(errOut), "\n")+1, errOut)
}

// A database without pgsaga's tables (the wrong one, or not migrated yet)
// is named, with the two ways out, instead of a "relation does not exist";
// migrate then brings it up to date.
func TestDatabaseWithoutTheSchema(t *testing.T) {
	t.Setenv("DATABASE_URL", emptyDatabase(t))

	for _, args := range [][]string{{"sagas"}, {"show", uuid.NewString()}, {"dead-letters"}} {
		code, _, errOut := pgsaga(t, args...)
		assert.Equal(t, exitFailed, code, "%v", args)
		assert.Contains(t, errOut, "holds no pgsaga schema", "%v", args)
		assert.Contains(t, errOut, "pgsaga migrate", "%v", args)
	}
	code, out, _ := pgsaga(t, "version")
	assert.Equal(t, exitOK, code)
	assert.Contains(t, out, "run pgsaga migrate")
	code, out, errOut := pgsaga(t, "migrate")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "applied")
	code, _, errOut = pgsaga(t, "sagas")
	assert.Equal(t, exitOK, code, errOut)
}

// emptyDatabase creates a database with no tables, dropped at the end of
// the test, and returns its URL.
func emptyDatabase(t *testing.T) string {
	t.Helper()
	admin := testdb.Shared(t)
	name := "pgsaga_cli_empty_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	_, err := admin.SQL.Exec(`CREATE DATABASE ` + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.SQL.Exec(`DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`) })
	u, err := url.Parse(admin.URL)
	require.NoError(t, err)
	u.Path = "/" + name
	return u.String()
}

// tablesIn counts the tables of the database url names, in any schema but
// the system's.
func tablesIn(t *testing.T, url string) int {
	t.Helper()
	var n int
	require.NoError(t, testdb.Open(t, url, 2).SQL.QueryRow(
		`SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')`).Scan(&n))
	return n
}

// sqlDB is a handle on the database DATABASE_URL names.
func sqlDB(t *testing.T) *sql.DB {
	t.Helper()
	return testdb.Open(t, os.Getenv("DATABASE_URL"), 2).SQL
}

// mustOperator is an unstarted client over db, as the commands use.
func mustOperator(t testing.TB, db *sql.DB) *saga.Client {
	t.Helper()
	c, err := operatorClient(db, nil)
	require.NoError(t, err)
	return c
}
