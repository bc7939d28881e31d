package sagatest_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/sagatest"
	"github.com/pgsaga/pgsaga/steps"
)

type visit struct {
	Guest string `json:"guest"`
}

func (visit) MessageType() string { return "kit.Visit" }

// runSaga builds, on db, a client whose deliveries run's faults reach, with
// a one-step saga whose step marks its guest in a table of its own; it
// returns the client, the saga and the table.
func runSaga(t *testing.T, db *sql.DB, run *sagatest.Run) (*saga.Client, *saga.Definition, string) {
	t.Helper()
	table := "visits_" + uuid.NewString()[:8]
	_, err := db.Exec(`CREATE TABLE ` + table + ` (guest text NOT NULL)`)
	require.NoError(t, err)
	client, err := saga.NewClientFromDB(db, saga.ClientConfig{Logger: sagatest.Logger(t),
		Transport: transport.Config{Intercept: run.Intercept, IdlePollInterval: testdb.NoSafetyPoll}})
	require.NoError(t, err)
	mark := steps.Define("kit.mark", "kit.mark", func(ctx context.Context, tx *steps.Tx, v visit) (steps.Message, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO `+table+` VALUES ($1)`, v.Guest)
		return steps.DoneReply{}, err
	})
	def := saga.MustDefine(saga.Spec[visit]{Name: "kit-visit",
		Trigger: saga.On("kit.visits", func(v visit) (string, visit, error) { return v.Guest, v, nil }),
		Steps:   []saga.Step[visit]{{Name: "mark", Action: saga.Send(mark, func(v visit) visit { return v }), Deadline: 5 * time.Second}},
	})
	require.NoError(t, client.Register(def))
	require.NoError(t, client.AddSteps(mark))
	return client, def, table
}

// The kit in Go's terms: a database of the test's own, faults in the
// client's deliveries, churning workers, and Finish, which waits for the
// sagas and checks every invariant, the test's own included.
func TestARunChecksItsSagas(t *testing.T) {
	t.Parallel()
	db := sagatest.DB(t)
	run := sagatest.New(t, db.SQL, sagatest.Faults{Seed: 7, DuplicateRate: 0.5, CrashBeforeCommitRate: 0.1, CrashAfterCommitRate: 0.1})
	client, def, table := runSaga(t, db.SQL, run)
	run.Start(client, 2)
	ctx := context.Background()
	tx, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	var ids []uuid.UUID
	for i := range 10 {
		id, err := client.StartTx(ctx, tx, def.Name, visit{Guest: fmt.Sprint("guest-", i)})
		require.NoError(t, err)
		ids = append(ids, id)
	}
	require.NoError(t, tx.Commit())
	counts := run.Finish(time.Minute, ids, []*saga.Definition{def}, sagatest.Invariant{
		Name: "one mark per guest",
		Check: func(ctx context.Context, db *sql.DB) ([]string, error) {
			return sagatest.Rows(ctx, db, `SELECT guest FROM `+table+` GROUP BY guest HAVING count(*) <> 1`)
		},
	})
	assert.Equal(t, 10, counts[saga.StatusCompleted])
	stats := run.Stats()
	assert.Positive(t, stats.Duplicated+stats.CrashesBefore+stats.CrashesAfter, "faults were injected: %+v", stats)
}

// recorder is a test that records its errors instead of failing.
type recorder struct {
	testing.TB
	errors []string
}

func (r *recorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// Finish fails the test itself, once for each broken invariant, with the
// rows that break it; and for sagas that never end.
func TestARunFailsTheTestOnABrokenInvariant(t *testing.T) {
	t.Parallel()
	db := sagatest.DB(t)
	rec := &recorder{TB: t}
	run := sagatest.New(rec, db.SQL, sagatest.Faults{Seed: 1})
	client, def, _ := runSaga(t, db.SQL, run)
	run.Start(client, 1)
	run.Start(client, 1)
	require.Equal(t, []string{"sagatest: Run.Start called twice, or after Finish; ignored"}, rec.errors)
	rec.errors = nil
	never := uuid.New()
	run.Finish(100*time.Millisecond, []uuid.UUID{never}, []*saga.Definition{def}, sagatest.Invariant{
		Name:  "always broken",
		Check: func(context.Context, *sql.DB) ([]string, error) { return []string{"row 1", "row 2"}, nil },
	})
	require.Len(t, rec.errors, 2, "%q", rec.errors)
	assert.Contains(t, rec.errors[0], "1 sagas unfinished")
	assert.Contains(t, rec.errors[0], never.String())
	assert.Equal(t, "sagatest: invariant broken: always broken: row 1; row 2", rec.errors[1])
}
