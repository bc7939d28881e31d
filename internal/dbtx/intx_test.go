package dbtx_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"testing"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// plainDriver hides that a pool's driver is pgx's: InTx then runs a
// database/sql transaction, as it does on any other driver.
type plainConnector struct{ driver.Connector }

func (c plainConnector) Driver() driver.Driver { return plainDriver{c.Connector.Driver()} }

type plainDriver struct{ driver.Driver }

// inTxDBs are a pgx pool whose round trips are counted (nil for the
// other) and a pool of another driver, both over a database holding
// pipe_probe (n int unique).
func inTxDBs(t *testing.T) map[string]*sql.DB {
	t.Helper()
	db := testdb.Fresh(t)
	_, err := db.SQL.Exec(`CREATE TABLE pipe_probe (n int UNIQUE)`)
	require.NoError(t, err)
	cfg, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	plain := sql.OpenDB(plainConnector{stdlib.GetConnector(*cfg)})
	t.Cleanup(func() { _ = plain.Close() })
	return map[string]*sql.DB{"pgx": db.SQL, "other driver": plain}
}

// On a pgx pool InTx is a Pipe: BEGIN, the queued writes and COMMIT go
// in one round trip. On another driver the same function commits the
// same rows.
func TestInTxCommitsWhatFnQueued(t *testing.T) {
	t.Parallel()
	for name, db := range inTxDBs(t) {
		t.Run(name, func(t *testing.T) {
			_, isPipe := db.Driver().(*stdlib.Driver)
			var pipe bool
			base := 10
			if !isPipe {
				base = 20
			}
			require.NoError(t, dbtx.InTx(context.Background(), db, "test", func(tx dbtx.DBTX) error {
				_, pipe = tx.(*dbtx.Pipe)
				require.NoError(t, dbtx.Queue(context.Background(), tx, "first", `INSERT INTO pipe_probe VALUES ($1)`, base+1))
				return dbtx.Queue(context.Background(), tx, "second", `INSERT INTO pipe_probe VALUES ($1)`, base+2)
			}))
			assert.Equal(t, isPipe, pipe, "a Pipe exactly on a pgx pool")
			assert.Subset(t, probeRows(t, db), []int{base + 1, base + 2})
		})
	}
}

func TestInTxIsOneRoundTripForQueuedWrites(t *testing.T) {
	t.Parallel()
	db, trips := testdb.RoundTrips(t, testdb.Fresh(t))
	_, err := db.SQL.Exec(`CREATE TABLE pipe_probe (n int UNIQUE)`)
	require.NoError(t, err)
	ctx := context.Background()
	write := func(n int) error {
		return dbtx.InTx(ctx, db.SQL, "test", func(tx dbtx.DBTX) error {
			return dbtx.Queue(ctx, tx, "writing", `INSERT INTO pipe_probe VALUES ($1)`, n)
		})
	}
	require.NoError(t, write(1)) // prepares the statement, a round trip of its own
	trips.Store(0)
	require.NoError(t, write(2))
	assert.EqualValues(t, 1, trips.Load())
	assert.Equal(t, []int{1, 2}, probeRows(t, db.SQL))
}

// fn's error rolls back what it queued and what it ran, and comes back
// as it is; a queued write's failure fails the commit, and nothing of the
// transaction is kept.
func TestInTxRollsBackOnFailure(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	for name, db := range inTxDBs(t) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			require.NoError(t, dbtx.InTx(ctx, db, "test", func(tx dbtx.DBTX) error {
				return dbtx.Queue(ctx, tx, "seeding", `INSERT INTO pipe_probe VALUES (1) ON CONFLICT DO NOTHING`)
			}))
			err := dbtx.InTx(ctx, db, "test", func(tx dbtx.DBTX) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO pipe_probe VALUES (2)`); err != nil {
					return err
				}
				require.NoError(t, dbtx.Queue(ctx, tx, "queued", `INSERT INTO pipe_probe VALUES (3)`))
				return boom
			})
			require.ErrorIs(t, err, boom)

			err = dbtx.InTx(ctx, db, "test", func(tx dbtx.DBTX) error {
				if err := dbtx.Queue(ctx, tx, "fine", `INSERT INTO pipe_probe VALUES (4)`); err != nil {
					return err
				}
				return dbtx.Queue(ctx, tx, "duplicate", `INSERT INTO pipe_probe VALUES (1)`)
			})
			var pgErr *pgconn.PgError
			require.True(t, errors.As(err, &pgErr), "the queued write's failure: %v", err)
			assert.Equal(t, pgerrcode.UniqueViolation, pgErr.Code)
			assert.Contains(t, err.Error(), "duplicate")
			assert.Equal(t, []int{1}, probeRows(t, db), "nothing of the failed transactions")
			var open int
			require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`).Scan(&open))
			assert.Zero(t, open, "no connection left in a transaction")
		})
	}
}
