package pgdb_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// Every form of connection string is described by its database, user and
// servers, never with its password; one that pgx cannot parse, or whose
// password may have spilled into another part, is said to be unparseable,
// and no part of it is shown, in the description or in an error.
func TestDescribeEveryForm(t *testing.T) {
	t.Parallel()
	unparseable := func(reason string) string { return "unparseable: " + reason }
	cases := []struct {
		name, in, want string
		secrets        []string // none may be shown
	}{
		{"url", "postgres://u:s3cr3t@h:5433/db?sslmode=disable", "database db as u on h:5433", []string{"s3cr3t"}},
		{"postgresql scheme, default port", "postgresql://u:s3cr3t@h/db", "database db as u on h:5432", []string{"s3cr3t"}},
		{"url, encoded '/', '@', '%'", "postgres://u:s3%2Fcr%40t%25x@h/db", "database db as u on h:5432", []string{"s3", "cr%40", "cr@t", "%25x"}},
		{"url, '#', '?', quotes and ':' unencoded", `postgres://u:s3#cr?3'"t:x@h/db`, "database db as u on h:5432", []string{"s3#", "cr?3", `3'"t`}},
		{"url, encoded space", "postgres://u:s3%20cr3t@h/db", "database db as u on h:5432", []string{"s3", "cr3t"}},
		{"url query password", "postgres://u@h/db?sslmode=disable&password=s3cr3t", "database db as u on h:5432", []string{"s3cr3t"}},
		{"url query sslpassword", "postgres://u@h/db?sslpassword=s3cr3t", "database db as u on h:5432", []string{"s3cr3t"}},
		{"url query password, encoded key", "postgres://u@h/db?pass%77ord=s3cr3t", "database db as u on h:5432", []string{"s3cr3t"}},
		{"url, several hosts", "postgres://u:s3cr3t@h1:5432,h2:5433/db", "database db as u on h1:5432, h2:5433", []string{"s3cr3t"}},
		{"url, IPv6", "postgres://u:s3cr3t@[::1]:5433/db", "database db as u on [::1]:5433", []string{"s3cr3t"}},
		{"url, unix socket", "postgres://u:s3cr3t@%2Fvar%2Frun%2Fpostgresql/db", "database db as u on socket /var/run/postgresql/.s.PGSQL.5432", []string{"s3cr3t"}},
		{"url, no database", "postgres://u:s3cr3t@h", "database u as u on h:5432", []string{"s3cr3t"}},
		{"keyword/value", "host=h user=u password=s3cr3t dbname=db", "database db as u on h:5432", []string{"s3cr3t"}},
		{"keyword/value, quoted, escaped quote, spaces", `host=h user=u password='it\'s a s3cr3t' dbname=db`, "database db as u on h:5432", []string{`it\'s`, "s3cr3t"}},
		{"keyword/value, '#', '/', '@', '?', '%'", "host=h user=u password=s3#c/r@3?t%z dbname=db", "database db as u on h:5432", []string{"s3#", "c/r", "r@3", "3?t", "%z"}},
		{"keyword/value, sslpassword", "host=h user=u sslpassword=s3cr3t dbname=db", "database db as u on h:5432", []string{"s3cr3t"}},
		{"keyword/value, unix socket", "host=/tmp port=5433 user=u password=s3cr3t dbname=db", "database db as u on socket /tmp/.s.PGSQL.5433", []string{"s3cr3t"}},
		{"keyword/value, a host and a socket", "host=h1,/tmp port=5432,5433 user=u password=s3cr3t dbname=db", "database db as u on h1:5432, socket /tmp/.s.PGSQL.5433", []string{"s3cr3t"}},
		{"keyword/value, IPv6", "host=::1 user=u password=s3cr3t dbname=db", "database db as u on [::1]:5432", []string{"s3cr3t"}},

		// What pgx cannot parse.
		{"url, '/' in the password", "postgres://u:s3cr/3t@h/db", unparseable("invalid port"), []string{"s3cr", "3t@"}},
		{"url, bad percent-escape", "postgres://u:s3cr3t%zz@h/db", unparseable("failed to parse as URL"), []string{"s3cr3t"}},
		{"url, bad port", "postgres://u:s3cr3t@h:notaport/db", unparseable("invalid port"), []string{"s3cr3t"}},
		{"url, unterminated IPv6", "postgres://u:s3cr3t@[::1/db", unparseable("failed to parse as URL"), []string{"s3cr3t"}},
		{"url, a query parameter without '='", "postgres://u@h/db?s3cr3t", unparseable("failed to parse as URL"), []string{"s3cr3t"}},
		{"keyword/value, bad port", "host=h PASSWORD=s3cr3t port=notaport", unparseable("invalid port"), []string{"s3cr3t"}},
		{"keyword/value, unterminated quote", "host=h user=u password='s3cr3t", unparseable("failed to parse as keyword/value"), []string{"s3cr3t"}},
		{"keyword/value, unquoted space", "host=h user=u password=s3 cr3t", unparseable("failed to parse as keyword/value"), []string{"s3", "cr3t"}},
		// pgx's reasons that quote a value are not given.
		{"keyword/value, a reason that quotes a value", "host=h target_session_attrs=s3cr3t", unparseable(""), []string{"s3cr3t"}},
		{"url, a reason that quotes a value", "postgres://h/db?min_protocol_version=s3cr3t", unparseable(""), []string{"s3cr3t"}},

		// What pgx parses, but with the password, or some of it, elsewhere.
		{"url, '/' in the password after digits", "postgres://u:1234/s3cr3t@h/db", unparseable("'@'"), []string{"1234", "s3cr3t"}},
		{"url, '@' in the password", "postgres://u:s3@cr3t@h/db", unparseable("'@'"), []string{"s3", "cr3t"}},
		{"url, '@' and '?' in the password", "postgres://u:s3@cr3t?x=y@h/db", unparseable("'@'"), []string{"s3", "cr3t"}},
		{"keyword/value, an unescaped quote in a quoted password", "host=h user=u password='s3' dbname=cr3t'", unparseable("quote"), []string{"s3", "cr3t"}},
		{"keyword/value, PASSWORD", "host=h user=u PASSWORD=s3cr3t dbname=db", unparseable("capitals"), []string{"s3cr3t"}},
		{"keyword/value, Password", "host=h user=u Password=s3cr3t dbname=db", unparseable("capitals"), []string{"s3cr3t"}},
		{"keyword/value, SSLPassword", "host=h user=u SSLPassword=s3cr3t dbname=db", unparseable("capitals"), []string{"s3cr3t"}},
		{"url query PASSWORD", "postgres://u@h/db?PASSWORD=s3cr3t", unparseable("capitals"), []string{"s3cr3t"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got := pgdb.Describe(c.in)
			_, err := pgdb.ParseConfig(c.in)
			var openErr error
			if reason, ok := strings.CutPrefix(c.want, "unparseable: "); ok {
				assert.Equal(t, fmt.Sprintf("an unparseable connection string (%d bytes)", len(c.in)), got)
				require.ErrorIs(t, err, pgdb.ErrUnparseable)
				assert.Contains(t, err.Error(), reason, "the reason is given")
				if reason == "" {
					assert.Equal(t, fmt.Sprintf("pgdb: an unparseable connection string (%d bytes)", len(c.in)), err.Error())
				}
				_, openErr = pgdb.Open(context.Background(), pgdb.Config{URL: c.in})
				require.ErrorIs(t, openErr, pgdb.ErrUnparseable)
				var pce *pgconn.ParseConfigError
				assert.False(t, errors.As(openErr, &pce), "pgx's error, which holds the string, is not wrapped")
			} else {
				assert.Equal(t, c.want, got)
				require.NoError(t, err)
			}
			testout.Hides(t, c.secrets, got, err, openErr)
		})
	}
}

// WithDatabase keeps the password exactly as written (however it is
// encoded) and fails without quoting it.
func TestWithDatabaseKeepsAndHidesPasswords(t *testing.T) {
	t.Parallel()
	got, err := pgdb.WithDatabase("postgres://u:p#ss?w@h1:5432,h2:5433/old?password=x%20y&sslmode=disable", "new db")
	require.NoError(t, err)
	assert.Equal(t, "postgres://u:p#ss?w@h1:5432,h2:5433/new%20db?password=x%20y&sslmode=disable", got)
	cfg, err := pgdb.ParseConfig(got)
	require.NoError(t, err)
	assert.Equal(t, "new db", cfg.ConnConfig.Database)
	assert.Equal(t, "x y", cfg.ConnConfig.Password, "the query's password wins, as before")

	_, err = pgdb.WithDatabase("postgres://u:s3cr3t@[::1/old", "new")
	require.ErrorIs(t, err, pgdb.ErrUnparseable)
	assert.NotContains(t, err.Error(), "s3cr3t")
}

// WithDatabase names the new database and no other: a database named
// anywhere in the string (the URL's path, a dbname= or database= query
// parameter, however often and however its key is encoded, a keyword/value
// dbname=) is replaced, and everything else is kept as written. A program
// that picks a database of its own (sagabench's fresh one, the payment
// service's) otherwise wrote into the one the string named in a parameter.
func TestWithDatabaseReplacesEveryDatabase(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, in, want string }{
		{"url, path only", "postgres://u:p@h:5432/old?sslmode=disable", "postgres://u:p@h:5432/new?sslmode=disable"},
		{"postgresql scheme", "postgresql://h/old", "postgresql://h/new"},
		{"url, no database", "postgres://h", "postgres://h/new"},
		{"url, empty path", "postgres://h/", "postgres://h/new"},
		{"url, dbname param only", "postgres://u@h/?dbname=prod", "postgres://u@h/new"},
		{"url, dbname param, no path", "postgres://u@h?dbname=prod&sslmode=disable", "postgres://u@h/new?sslmode=disable"},
		{"url, path and param alike", "postgres://u@h/prod?dbname=prod", "postgres://u@h/new"},
		{"url, path and param differ", "postgres://u@h/old?sslmode=disable&dbname=prod&application_name=x", "postgres://u@h/new?sslmode=disable&application_name=x"},
		{"url, database param", "postgres://u@h/old?database=prod", "postgres://u@h/new"},
		{"url, repeated params", "postgres://u@h/old?dbname=a&sslmode=disable&database=b&dbname=c", "postgres://u@h/new?sslmode=disable"},
		{"url, encoded key", "postgres://u@h/old?db%6Eame=prod&sslmode=disable", "postgres://u@h/new?sslmode=disable"},
		{"url, other params alike kept", "postgres://u@h/old?application_name=dbname&options=-c%20x%3Ddbname", "postgres://u@h/new?application_name=dbname&options=-c%20x%3Ddbname"},
		{"keyword/value", "host=h user=u dbname=old", "host=h user=u dbname='new'"},
		{"keyword/value, no database", "host=h user=u", "host=h user=u dbname='new'"},
		{"keyword/value, empty", "", "dbname='new'"},
		{"keyword/value, repeated, database spelling", "dbname=a host=h database=b user=u dbname=c", "host=h user=u dbname='new'"},
		{"keyword/value, spaces around '='", "host=h dbname = prod user=u", "host=h user=u dbname='new'"},
		{"keyword/value, quotes and escapes", `host=h dbname='it\'s prod' password='dbname=x \\' user=u`, `host=h password='dbname=x \\' user=u dbname='new'`},
		{"keyword/value, escaped space", `dbname=my\ prod host=h`, `host=h dbname='new'`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got, err := pgdb.WithDatabase(c.in, "new")
			require.NoError(t, err)
			assert.Equal(t, c.want, got)
			cfg, err := pgdb.ParseConfig(got)
			require.NoError(t, err)
			assert.Equal(t, "new", cfg.ConnConfig.Database)
		})
	}
	// A name that needs quoting or encoding in either form (ParseConfig
	// refuses a quote in a keyword/value database name; pgx reads it).
	got, err := pgdb.WithDatabase(`host=h dbname=old`, `it's a \ db`)
	require.NoError(t, err)
	pcfg, err := pgconn.ParseConfig(got)
	require.NoError(t, err)
	assert.Equal(t, `it's a \ db`, pcfg.Database)
	got, err = pgdb.WithDatabase(`host=h dbname=old`, `a \ db`)
	require.NoError(t, err)
	cfg, err := pgdb.ParseConfig(got)
	require.NoError(t, err)
	assert.Equal(t, `a \ db`, cfg.ConnConfig.Database)
	got, err = pgdb.WithDatabase(`postgres://h/old?dbname=x`, `a/b?c&d=e f`)
	require.NoError(t, err)
	cfg, err = pgdb.ParseConfig(got)
	require.NoError(t, err)
	assert.Equal(t, `a/b?c&d=e f`, cfg.ConnConfig.Database)
}

// A keyword/value string WithDatabase cannot read fails, quoting none of it.
func TestWithDatabaseRefusesAnUnreadableKeywordValueString(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"host=h password='s3cr3t", "host=h s3cr3t"} {
		_, err := pgdb.WithDatabase(in, "new")
		require.ErrorIs(t, err, pgdb.ErrUnparseable, in)
		assert.NotContains(t, err.Error(), "s3cr3t")
	}
}
