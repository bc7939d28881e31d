// Package pgdb opens the single PostgreSQL connection pool a pgsaga process uses.
//
// One pgx pool serves both pgx-native code and the database/sql handle that
// watermill-sql needs (the pgx stdlib bridge over the same pool), so the
// connection limit is counted once.
package pgdb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	pgxuuid "github.com/vgarvardt/pgx-google-uuid/v5"
)

// EnvURL is the environment variable that names the database, as a libpq URL
// (postgres://user:password@host:port/dbname?sslmode=disable) or key/value string.
const EnvURL = "DATABASE_URL"

// ErrNoURL is returned by Open when no URL was configured.
var ErrNoURL = errors.New("pgdb: no database URL (set " + EnvURL + ")")

// Config configures Open.
type Config struct {
	// URL is the libpq connection string. Default: the DATABASE_URL
	// environment variable, unless Environment is set.
	URL string
	// Environment, with no URL, connects as libpq would with an empty
	// connection string: with the PG* variables (PGHOST, PGPORT,
	// PGDATABASE, PGUSER, PGPASSWORD, PGSSLMODE, …), ~/.pgpass and
	// libpq's defaults.
	Environment bool
	// MaxConns bounds the pool, and so everything the process does with the database.
	// Default: 16.
	MaxConns int32
	// ApplicationName is reported in pg_stat_activity. Default: "pgsaga".
	ApplicationName string
	// ConnectTimeout bounds the initial ping. Default: 10s.
	ConnectTimeout time.Duration
	// Tracer sees every statement the pool's connections send (pgx's
	// QueryTracer, and BatchTracer if it has the method). Default: none.
	Tracer pgx.QueryTracer
}

func (c *Config) setDefaults() {
	if c.URL == "" && !c.Environment {
		c.URL = os.Getenv(EnvURL)
	}
	if c.MaxConns == 0 {
		c.MaxConns = 16
	}
	if c.ApplicationName == "" {
		c.ApplicationName = "pgsaga"
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 10 * time.Second
	}
}

func (c *Config) validate() error {
	if c.URL == "" && !c.Environment {
		return ErrNoURL
	}
	if c.MaxConns < 2 {
		return fmt.Errorf("pgdb: MaxConns must be at least 2, got %d", c.MaxConns)
	}
	if c.ConnectTimeout < 0 {
		return fmt.Errorf("pgdb: ConnectTimeout must not be negative, got %s", c.ConnectTimeout)
	}
	return nil
}

// DB is a pgx pool and the database/sql handle over it.
type DB struct {
	// Pool is the pgx pool. Everything in the process shares it.
	Pool *pgxpool.Pool
	// SQL is a database/sql handle whose connections come from Pool.
	SQL *sql.DB
}

// Open connects to the database and checks that it answers. A URL
// ParseConfig refuses is ErrUnparseable; its errors name the database as
// Describe does, never by the URL.
func Open(ctx context.Context, cfg Config) (*DB, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	pcfg, err := ParseConfig(cfg.URL)
	if err != nil {
		return nil, err
	}
	where := describe(&pcfg.ConnConfig.Config)
	pcfg.MaxConns = cfg.MaxConns
	if cfg.Tracer != nil {
		pcfg.ConnConfig.Tracer = cfg.Tracer
	}
	if _, ok := pcfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName
	}
	pcfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		EncodeUUIDs(c.TypeMap())
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("pgdb: creating pool for %s: %w", where, err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("pgdb: connecting to %s: %w", where, err)
	}
	return &DB{Pool: pool, SQL: stdlib.OpenDBFromPool(pool)}, nil
}

// EncodeUUIDs makes m encode a google/uuid UUID argument as the 16 bytes it
// is. pgx otherwise takes it as a driver.Valuer: its text, an encode error
// for the binary format, a scan of the text and a second encode, some 20
// allocations for every uuid argument of every statement. Scans are left
// as they are (database/sql scans into uuid.UUID through its Scanner).
func EncodeUUIDs(m *pgtype.Map) {
	m.TryWrapEncodePlanFuncs = append([]pgtype.TryWrapEncodePlanFunc{pgxuuid.TryWrapUUIDEncodePlan}, m.TryWrapEncodePlanFuncs...)
}

// Connect opens one connection, not a pool, to the database connString
// names, for a short task. Its errors are Open's.
func Connect(ctx context.Context, connString string) (*pgx.Conn, error) {
	cfg, err := ParseConfig(connString)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return nil, fmt.Errorf("pgdb: connecting to %s: %w", describe(&cfg.ConnConfig.Config), err)
	}
	return conn, nil
}

// Close closes the database/sql handle, then the pool.
func (db *DB) Close() {
	_ = db.SQL.Close()
	db.Pool.Close()
}
