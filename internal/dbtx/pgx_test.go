package dbtx_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/dbtx"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// scanned is what a row of the probe query scans into.
type scanned struct {
	I       int
	I64     int64
	F       float64
	B       bool
	S       string
	Null    sql.NullString
	NullI   sql.NullInt64
	T       time.Time
	Bytes   []byte
	JSON    json.RawMessage
	ID      uuid.UUID
	Numeric string
	Any     any
}

const probeSQL = `SELECT $1::int, 9000000000::bigint, 1.5::float8, true, 'héllo'::text, NULL::text, NULL::bigint,
    '2026-11-29 01:02:03.456789+00'::timestamptz, '\x00ff10'::bytea, '{"a": [1, "x"]}'::jsonb,
    'b6f2a4c8-2d4e-4f51-9a3b-0c1d2e3f4a5b'::uuid, 12.50::numeric, 'any'::text
FROM generate_series(1, $2) AS g WHERE g = ANY ($3::int[])`

func scanAll(t *testing.T, rows *sql.Rows, err error) []scanned {
	t.Helper()
	require.NoError(t, err)
	defer rows.Close()
	var out []scanned
	for rows.Next() {
		var s scanned
		require.NoError(t, rows.Scan(&s.I, &s.I64, &s.F, &s.B, &s.S, &s.Null, &s.NullI, &s.T, &s.Bytes, &s.JSON, &s.ID, &s.Numeric, &s.Any))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// assertSameProbe checks that two reads of probeSQL scanned the same.
func assertSameProbe(t *testing.T, want, got []scanned) {
	t.Helper()
	require.Len(t, want, 2)
	require.Len(t, got, len(want))
	for i := range want {
		assert.True(t, want[i].T.Equal(got[i].T), "times: %v %v", want[i].T, got[i].T)
		want[i].T, got[i].T = time.Time{}, time.Time{}
		assert.JSONEq(t, string(want[i].JSON), string(got[i].JSON))
		want[i].JSON, got[i].JSON = nil, nil
	}
	assert.Equal(t, want, got)
}

// A pgx transaction as a DBTX scans what pgx's database/sql driver scans,
// type by type, and runs its statements in that transaction.
func TestFromPgxScansAsDatabaseSQLDoes(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	ctx := context.Background()

	stdTx, err := db.SQL.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer stdTx.Rollback() //nolint:errcheck
	pgxTx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer pgxTx.Rollback(ctx) //nolint:errcheck
	q := dbtx.FromPgx(pgxTx)

	rows, err := stdTx.QueryContext(ctx, probeSQL, 7, 3, []int{1, 3})
	want := scanAll(t, rows, err)
	rows, err = q.QueryContext(ctx, probeSQL, 7, 3, []int{1, 3})
	got := scanAll(t, rows, err)
	assertSameProbe(t, want, got)
	assert.Equal(t, []byte{0, 0xff, 0x10}, got[0].Bytes)

	// Where the session's settings change the text of times, dates and
	// bytes, and for values past what time.Time holds, the same again.
	for _, set := range []string{`SET LOCAL DateStyle = 'SQL, DMY'`, `SET LOCAL DateStyle = 'German'`, `SET LOCAL bytea_output = 'escape'`,
		`SET LOCAL extra_float_digits = 0`} {
		_, err := stdTx.ExecContext(ctx, set)
		require.NoError(t, err)
		_, err = q.ExecContext(ctx, set)
		require.NoError(t, err)
		odd := `SELECT '2024-01-02 03:04:05+00'::timestamptz, '2024-01-02'::date, '2024-01-02 03:04:05'::timestamp,
    'infinity'::timestamptz, '-infinity'::date, '\x00ff10'::bytea, 1.1::float4, 0.1::float8 + 0.2::float8, '42'::xid, '<a/>'::xml, $1::int`
		collect := func(rows *sql.Rows, err error) [][]any {
			require.NoError(t, err, set)
			defer rows.Close()
			var out [][]any
			for rows.Next() {
				vals := make([]any, 11)
				ptrs := make([]any, len(vals))
				for i := range vals {
					ptrs[i] = &vals[i]
				}
				require.NoError(t, rows.Scan(ptrs...), set)
				out = append(out, vals)
			}
			require.NoError(t, rows.Err())
			return out
		}
		want := collect(stdTx.QueryContext(ctx, odd, sql.Named("n", 7)))
		got := collect(q.QueryContext(ctx, odd, sql.Named("n", 7)))
		assert.Equal(t, want, got, set)
	}

	// One row; none (an error, at Scan as database/sql has it, last).
	var n int
	require.NoError(t, q.QueryRowContext(ctx, `SELECT 41 + $1::int`, 1).Scan(&n))
	assert.Equal(t, 42, n)
	require.ErrorIs(t, q.QueryRowContext(ctx, `SELECT 1 WHERE false`).Scan(&n), sql.ErrNoRows)

	// Statements run in the pgx transaction: its savepoints, its rows.
	_, err = q.ExecContext(ctx, `CREATE TEMPORARY TABLE probe (n int) ON COMMIT DROP`)
	require.NoError(t, err)
	res, err := q.ExecContext(ctx, `INSERT INTO probe SELECT generate_series(1, $1)`, 3)
	require.NoError(t, err)
	affected, err := res.RowsAffected()
	require.NoError(t, err)
	assert.EqualValues(t, 3, affected)
	_, err = q.ExecContext(ctx, `SAVEPOINT s; DELETE FROM probe; ROLLBACK TO SAVEPOINT s; RELEASE SAVEPOINT s`)
	require.NoError(t, err)
	require.NoError(t, pgxTx.QueryRow(ctx, `SELECT count(*) FROM probe`).Scan(&n))
	assert.Equal(t, 3, n, "the same transaction")
	require.ErrorContains(t, q.QueryRowContext(ctx, `SELECT nonsense`).Scan(&n), "nonsense")
	_, err = q.QueryContext(ctx, `SELECT 1`)
	require.ErrorContains(t, err, "25P02", "the failed statement aborted the pgx transaction")
}
