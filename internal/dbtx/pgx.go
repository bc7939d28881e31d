package dbtx

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// FromPgx returns tx as a DBTX: a caller's pgx transaction, for the
// packages that take one (a saga started in it, messages published in it).
// Statements run on tx as they are called; a query's rows are read in full
// before it returns (in PostgreSQL's text format, converted as pgx's
// database/sql driver converts them), so what database/sql scans from them
// is what it scans from *sql.Tx's.
func FromPgx(tx pgx.Tx) DBTX { return pgxTx{tx: tx} }

type pgxTx struct{ tx pgx.Tx }

func (p pgxTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	tag, err := p.tx.Exec(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return driver.RowsAffected(tag.RowsAffected()), nil
}

func (p pgxTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return p.read(ctx, query, args).Rows(ctx)
}

func (p pgxTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return p.read(ctx, query, args).Row(ctx)
}

// read runs query and reads its rows, every column in text format.
func (p pgxTx) read(ctx context.Context, query string, args []any) Result {
	rows, err := p.tx.Query(ctx, query, append([]any{pgx.QueryResultFormats{pgx.TextFormatCode}}, args...)...)
	if err != nil {
		return Result{Err: err}
	}
	defer rows.Close()
	fields := rows.FieldDescriptions()
	r := Result{Columns: make([]string, len(fields))}
	for i, f := range fields {
		r.Columns[i] = f.Name
	}
	types := p.tx.Conn().TypeMap()
	for rows.Next() {
		raw := rows.RawValues()
		row := make([]driver.Value, len(raw))
		for i, b := range raw {
			if row[i], err = textValue(types, fields[i].DataTypeOID, b); err != nil {
				return Result{Err: fmt.Errorf("dbtx: reading column %s: %w", fields[i].Name, err)}
			}
		}
		r.Values = append(r.Values, row)
	}
	if err := rows.Err(); err != nil {
		return Result{Err: err}
	}
	return r
}

// textValue is the database/sql value of a column's text b: numbers,
// booleans and times as Go's, bytea as its bytes, JSON as its text's
// bytes, NULL as nil, anything else as its text (a string).
func textValue(types *pgtype.Map, oid uint32, b []byte) (driver.Value, error) {
	if b == nil {
		return nil, nil
	}
	switch oid {
	case pgtype.Int2OID, pgtype.Int4OID, pgtype.Int8OID, pgtype.OIDOID:
		return strconv.ParseInt(string(b), 10, 64)
	case pgtype.Float4OID, pgtype.Float8OID:
		return strconv.ParseFloat(string(b), 64)
	case pgtype.BoolOID:
		return string(b) == "t", nil
	case pgtype.TimestamptzOID, pgtype.TimestampOID, pgtype.DateOID:
		var t time.Time
		if err := types.Scan(oid, pgtype.TextFormatCode, b, &t); err != nil {
			return nil, err
		}
		return t, nil
	case pgtype.ByteaOID:
		var out []byte
		if err := types.Scan(oid, pgtype.TextFormatCode, b, &out); err != nil {
			return nil, err
		}
		return out, nil
	case pgtype.JSONOID, pgtype.JSONBOID:
		return append([]byte(nil), b...), nil
	}
	return string(b), nil
}
