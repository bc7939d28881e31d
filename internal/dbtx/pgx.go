package dbtx

import (
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// FromPgx returns tx as a DBTX: a caller's pgx transaction, for the
// packages that take one (a saga started in it, messages published in it).
// Statements run on tx as they are called; a query's rows are read in full
// before it returns, in the formats and with the conversions of pgx's
// database/sql driver, so what database/sql scans from them is what it
// scans from a *sql.Tx's (an error after some rows fails the whole query;
// a large result is held in memory: it is for a transaction's small
// reads).
func FromPgx(tx pgx.Tx) DBTX { return pgxTx{tx: tx} }

type pgxTx struct{ tx pgx.Tx }

func (p pgxTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	tag, err := p.tx.Exec(ctx, query, positional(args)...)
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

// binaryResults are the columns read in binary format, as pgx's
// database/sql driver reads them (its "intrinsic" types); the others come
// in text format.
var binaryResults = pgx.QueryResultFormatsByOID{
	pgtype.BoolOID: pgx.BinaryFormatCode, pgtype.ByteaOID: pgx.BinaryFormatCode, pgtype.CIDOID: pgx.BinaryFormatCode,
	pgtype.DateOID: pgx.BinaryFormatCode, pgtype.Float4OID: pgx.BinaryFormatCode, pgtype.Float8OID: pgx.BinaryFormatCode,
	pgtype.Int2OID: pgx.BinaryFormatCode, pgtype.Int4OID: pgx.BinaryFormatCode, pgtype.Int8OID: pgx.BinaryFormatCode,
	pgtype.OIDOID: pgx.BinaryFormatCode, pgtype.TimestampOID: pgx.BinaryFormatCode,
	pgtype.TimestamptzOID: pgx.BinaryFormatCode, pgtype.XIDOID: pgx.BinaryFormatCode,
}

// read runs query and reads its rows, in full.
func (p pgxTx) read(ctx context.Context, query string, args []any) Result {
	rows, err := p.tx.Query(ctx, query, append([]any{binaryResults}, positional(args)...)...)
	if err != nil {
		return Result{Err: err}
	}
	return readPgxRows(rows, p.tx.Conn())
}

// readPgxRows reads rows of a query on conn, in full, and closes them.
func readPgxRows(rows pgx.Rows, conn *pgx.Conn) Result {
	defer rows.Close()
	fields := rows.FieldDescriptions()
	r := Result{Columns: columnNames(fields)}
	for rows.Next() {
		row, err := decodeRow(conn.TypeMap(), fields, rows.RawValues())
		if err != nil {
			return Result{Err: err}
		}
		r.Values = append(r.Values, row)
	}
	if err := rows.Err(); err != nil {
		return Result{Err: err}
	}
	return r
}

func columnNames(fields []pgconn.FieldDescription) []string {
	names := make([]string, len(fields))
	for i, f := range fields {
		names[i] = f.Name
	}
	return names
}

// decodeRow is the database/sql values of a row's columns (see sqlValue).
func decodeRow(types *pgtype.Map, fields []pgconn.FieldDescription, raw [][]byte) ([]driver.Value, error) {
	row := make([]driver.Value, len(raw))
	for i, b := range raw {
		if b == nil {
			continue
		}
		var err error
		if row[i], err = sqlValue(types, fields[i], b); err != nil {
			return nil, fmt.Errorf("dbtx: reading column %s: %w", fields[i].Name, err)
		}
	}
	return row, nil
}

// positional passes database/sql's named arguments by their values, as
// pgx's database/sql driver does.
func positional(args []any) []any {
	var out []any
	for i, a := range args {
		if n, ok := a.(sql.NamedArg); ok {
			if out == nil {
				out = append([]any(nil), args...)
			}
			out[i] = n.Value
		}
	}
	if out == nil {
		return args
	}
	return out
}

// sqlValue is the database/sql value of a column's bytes b, as pgx's
// database/sql driver makes it: Go numbers, booleans and bytes for the
// intrinsic types, pgtype's values for dates and times (a string for
// infinity), JSON and XML as bytes, anything else as its text.
func sqlValue(types *pgtype.Map, f pgconn.FieldDescription, b []byte) (driver.Value, error) {
	scan := func(target any) error { return types.Scan(f.DataTypeOID, f.Format, b, target) }
	switch f.DataTypeOID {
	case pgtype.BoolOID:
		var v bool
		return v, scan(&v)
	case pgtype.ByteaOID, pgtype.JSONOID, pgtype.JSONBOID, pgtype.XMLOID:
		var v []byte
		if err := scan(&v); err != nil {
			return nil, err
		}
		return bytes.Clone(v), nil
	case pgtype.Int2OID, pgtype.Int4OID, pgtype.Int8OID:
		var v int64
		return v, scan(&v)
	case pgtype.Float4OID:
		var v float32
		return float64(v), scan(&v)
	case pgtype.Float8OID:
		var v float64
		return v, scan(&v)
	case pgtype.CIDOID, pgtype.OIDOID, pgtype.XIDOID:
		return valueOf[pgtype.Uint32](scan)
	case pgtype.DateOID:
		return valueOf[pgtype.Date](scan)
	case pgtype.TimestampOID:
		return valueOf[pgtype.Timestamp](scan)
	case pgtype.TimestamptzOID:
		return valueOf[pgtype.Timestamptz](scan)
	}
	var v string
	return v, scan(&v)
}

// valueOf scans into a T and returns its database/sql value (pgtype's
// Value: a time, or a string such as "infinity").
func valueOf[T any, P interface {
	*T
	driver.Valuer
}](scan func(any) error) (driver.Value, error) {
	var v T
	if err := scan(P(&v)); err != nil {
		return nil, err
	}
	return P(&v).Value()
}
