package pgdb_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
)

// Every form a password takes in a connection string is masked, and
// nothing else of the string changes.
func TestRedactEveryForm(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, in, want string
		secrets        []string // none may survive
	}{
		{"url userinfo", "postgres://u:s3cr3t@h:5432/db?sslmode=disable", "postgres://u:xxxxx@h:5432/db?sslmode=disable", []string{"s3cr3t"}},
		{"postgresql scheme", "postgresql://u:s3cr3t@h/db", "postgresql://u:xxxxx@h/db", []string{"s3cr3t"}},
		{"url userinfo, encoded", "postgres://u:p%40ss%2Fw%3Ard@h/db", "postgres://u:xxxxx@h/db", []string{"p%40ss", "w%3Ard"}},
		{"url userinfo, '#' and '?' unencoded", "postgres://u:p#ss?w@h/db", "postgres://u:xxxxx@h/db", []string{"p#ss", "ss?w"}},
		{"url userinfo, several hosts", "postgres://u:s3cr3t@h1:5432,h2:5433/db", "postgres://u:xxxxx@h1:5432,h2:5433/db", []string{"s3cr3t"}},
		{"url, no password", "postgres://u@h/db", "postgres://u@h/db", nil},
		{"url, empty password", "postgres://u:@h/db", "postgres://u:@h/db", nil},
		{"url, no userinfo", "postgres://h/db?sslmode=disable", "postgres://h/db?sslmode=disable", nil},
		{"url query password", "postgres://u@h/db?sslmode=disable&password=s3cr3t", "postgres://u@h/db?sslmode=disable&password=xxxxx", []string{"s3cr3t"}},
		{"url query password, encoded key and value", "postgres://h/db?pass%77ord=s3%20cr3t&application_name=x", "postgres://h/db?pass%77ord=xxxxx&application_name=x", []string{"s3%20cr3t", "cr3t"}},
		{"url query sslpassword", "postgres://h/db?sslpassword=k3y&sslmode=require", "postgres://h/db?sslpassword=xxxxx&sslmode=require", []string{"k3y"}},
		{"url, both places", "postgres://u:one1@h/db?password=two2", "postgres://u:xxxxx@h/db?password=xxxxx", []string{"one1", "two2"}},
		{"url, '@' in a query value", "postgres://u:s3cr3t@h/db?application_name=a@b", "postgres://u:xxxxx@h/db?application_name=a@b", []string{"s3cr3t"}},
		{"url, IPv6 host", "postgres://u:s3cr3t@[::1]:5432/db?password=again", "postgres://u:xxxxx@[::1]:5432/db?password=xxxxx", []string{"s3cr3t", "again"}},
		{"keyword/value", "host=h user=u password=s3cr3t dbname=db", "host=h user=u password=xxxxx dbname=db", []string{"s3cr3t"}},
		{"keyword/value, first", "password=s3cr3t host=h", "password=xxxxx host=h", []string{"s3cr3t"}},
		{"keyword/value, spaces around '='", "host=h password = s3cr3t dbname=db", "host=h password = xxxxx dbname=db", []string{"s3cr3t"}},
		{"keyword/value, quoted with spaces", "host=h password='se cr3t' dbname=db", "host=h password=xxxxx dbname=db", []string{"se cr3t", "cr3t"}},
		{"keyword/value, quoted with escaped quote", `host=h password='it\'s a s3cr3t' dbname=db`, "host=h password=xxxxx dbname=db", []string{"it\\'s", "s3cr3t", "a s3"}},
		{"keyword/value, escaped space unquoted", `host=h password=se\ cr3t dbname=db`, "host=h password=xxxxx dbname=db", []string{"se\\", "cr3t"}},
		{"keyword/value, quoted, escaped backslash", `password='a\\' host=h`, "password=xxxxx host=h", []string{`a\\`}},
		{"keyword/value, tabs", "host=h\tpassword=s3cr3t\tdbname=db", "host=h\tpassword=xxxxx\tdbname=db", []string{"s3cr3t"}},
		{"keyword/value, sslpassword", "host=h sslpassword=k3y", "host=h sslpassword=xxxxx", []string{"k3y"}},
		{"keyword/value, given twice", "password=one1 host=h password='two 2'", "password=xxxxx host=h password=xxxxx", []string{"one1", "two 2"}},
		{"keyword/value, empty quoted", "host=h password=''", "host=h password=xxxxx", nil},
		{"keyword/value, no password", "host=h user=u dbname=db", "host=h user=u dbname=db", nil},
		{"empty", "", "", nil},
		// Strings pgx cannot read are hidden whole: where the password ends
		// is anybody's guess.
		{"keyword/value, unterminated quote", "host=h password='s3cr3t", pgdb.Unreadable, []string{"s3cr3t"}},
		{"keyword/value, unquoted space", "host=h password=s3 cr3t", pgdb.Unreadable, []string{"s3", "cr3t"}},
		{"url, unterminated IPv6 bracket", "postgres://u:s3cr3t@[::1/db", pgdb.Unreadable, []string{"s3cr3t"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := pgdb.Redact(c.in)
			assert.Equal(t, c.want, got)
			for _, s := range c.secrets {
				assert.NotContains(t, got, s)
			}
		})
	}
}

// The embedded server's well-known password is masked without mangling the
// rest of its URL, which spells the same word.
func TestRedactPasswordThatIsAlsoTheUser(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "postgres://postgres:xxxxx@127.0.0.1:54329/pgsaga?sslmode=disable",
		pgdb.Redact("postgres://postgres:postgres@127.0.0.1:54329/pgsaga?sslmode=disable"))
}

// A password that comes from PGPASSWORD, not from the string, leaves the
// string as it is, even when the string happens to spell it.
func TestRedactPasswordFromEnvironment(t *testing.T) {
	t.Setenv("PGPASSWORD", "h")
	assert.Equal(t, "host=h user=u", pgdb.Redact("host=h user=u"))
	assert.Equal(t, "postgres://u@h/db", pgdb.Redact("postgres://u@h/db"))
}

// Open's errors quote the string as Redact does, not as pgx does: pgx's own
// masking misses the end of a quoted password holding an escaped quote.
func TestOpenErrorsHidePasswords(t *testing.T) {
	t.Parallel()
	for _, url := range []string{
		`host=127.0.0.1 port=notaport user=u password='it\'s s3cr3t' dbname=db`,
		`postgres://u:s3cr3t@127.0.0.1:notaport/db`,
		`postgres://u@127.0.0.1/db?password=s3cr3t&pool_max_conns=many`,
		`host=127.0.0.1 password=s3cr3t sslmode=bogus`,
		`host=127.0.0.1 password='s3cr3t`,
	} {
		_, err := pgdb.Open(context.Background(), pgdb.Config{URL: url, MaxConns: 4})
		require.Error(t, err, url)
		assert.NotContains(t, err.Error(), "s3cr3t", url)
		var pce *pgconn.ParseConfigError
		assert.True(t, errors.As(err, &pce), "still a pgx parse error: %v", err)
	}
}

// WithDatabase keeps the password exactly as written (however it is
// encoded) and fails without quoting it.
func TestWithDatabaseKeepsAndHidesPasswords(t *testing.T) {
	t.Parallel()
	got, err := pgdb.WithDatabase("postgres://u:p#ss?w@h1:5432,h2:5433/old?password=x%20y&sslmode=disable", "new db")
	require.NoError(t, err)
	assert.Equal(t, "postgres://u:p#ss?w@h1:5432,h2:5433/new%20db?password=x%20y&sslmode=disable", got)
	cfg, err := pgconn.ParseConfig(got)
	require.NoError(t, err)
	assert.Equal(t, "new db", cfg.Database)
	assert.Equal(t, "x y", cfg.Password, "the query's password wins, as before")

	_, err = pgdb.WithDatabase("postgres://u:s3cr3t@[::1/old", "new")
	require.Error(t, err)
	assert.False(t, strings.Contains(err.Error(), "s3cr3t"), err.Error())
}
