package pgdb

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrUnparseable is returned for a connection string pgdb will not use:
// pgx cannot parse it, or it can but a password may have spilled out of
// its place into a part that is shown (see ParseConfig). The error's
// message holds no part of the string, only its length and, where that
// gives nothing of the string away, pgx's reason.
var ErrUnparseable = errors.New("unparseable connection string")

type unparseableError struct {
	size   int
	reason string
}

func (e *unparseableError) Error() string {
	if e.reason == "" {
		return "pgdb: " + unparseable(e.size)
	}
	return "pgdb: " + unparseable(e.size) + ": " + e.reason
}

func (e *unparseableError) Is(target error) bool { return target == ErrUnparseable }

func unparseable(size int) string {
	return fmt.Sprintf("an unparseable connection string (%d bytes)", size)
}

// ParseConfig parses connString, a libpq URL or keyword/value string, as
// Open does (pgxpool.ParseConfig). Its errors are ErrUnparseable: pgx's
// quote the string, with the passwords they recognise masked, which a
// malformed string defeats. It also refuses strings pgx reads whose
// password may have landed in the host list, the user or the database
// name, which Describe and pgx's connection errors show:
//   - a URL with an '@' other than the one that ends its user and
//     password: pgx ends the userinfo at the first '@' before any '/', so
//     an unencoded '/' or '@' in the password puts the rest of it among the
//     hosts, the database or the query (write them %2F and %40);
//   - a keyword/value string with a quote in a host, user or database
//     name: a quoted password holding an unescaped quote ends there, and
//     the rest of it is read as other settings;
//   - a password or sslpassword setting spelt with capitals (PASSWORD=):
//     pgx takes it for a server setting and would send it to the server
//     as one.
func ParseConfig(connString string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, &unparseableError{size: len(connString), reason: pgxReason(err)}
	}
	if reason := doubt(connString, &cfg.ConnConfig.Config); reason != "" {
		return nil, &unparseableError{size: len(connString), reason: reason}
	}
	return cfg, nil
}

// Describe says which database connString connects to, for people: the
// database, the user and the servers (host:port, or a Unix socket's path),
// as in "database pgsaga as postgres on 127.0.0.1:5432". It never shows a
// password or the string itself: one ParseConfig refuses is described as
// an unparseable connection string of its length.
func Describe(connString string) string {
	cfg, err := ParseConfig(connString)
	if err != nil {
		return unparseable(len(connString))
	}
	return describe(&cfg.ConnConfig.Config)
}

func describe(c *pgconn.Config) string {
	db := c.Database
	if db == "" {
		db = c.User // the server's default
	}
	return fmt.Sprintf("database %s as %s on %s", db, c.User, strings.Join(servers(c), ", "))
}

// servers lists the servers c tries, in order, each once (pgx lists a
// server twice when it tries it with TLS, then without).
func servers(c *pgconn.Config) []string {
	var list []string
	add := func(host string, port uint16) {
		s := net.JoinHostPort(host, strconv.Itoa(int(port)))
		if strings.HasPrefix(host, "/") {
			s = "socket " + path.Join(host, ".s.PGSQL."+strconv.Itoa(int(port)))
		}
		if !slices.Contains(list, s) {
			list = append(list, s)
		}
	}
	add(c.Host, c.Port)
	for _, f := range c.Fallbacks {
		add(f.Host, f.Port)
	}
	return list
}

// pgxReasons are the reasons pgx gives for refusing a connection string
// that hold no part of it (others quote a setting's value).
var pgxReasons = regexp.MustCompile(`^(failed to parse as (URL|keyword/value)|invalid (port|connect_timeout|sslcertmode|require_auth)|` +
	`failed to configure TLS|failed to read service|could not match \d+ port numbers to \d+ hosts|` +
	`min_protocol_version cannot be greater than max_protocol_version|cannot parse pool_[a-z_]+|pool_max_conns too small)$`)

// pgxReason is pgx's reason for refusing a connection string, if it is
// one of pgxReasons, else "".
func pgxReason(err error) string {
	var pce *pgconn.ParseConfigError
	if !errors.As(err, &pce) {
		return ""
	}
	bare := *pce
	bare.ConnString = "" // its message: "cannot parse ``: reason (cause)"
	reason := strings.TrimPrefix(bare.Error(), "cannot parse ``: ")
	if cause := errors.Unwrap(pce); cause != nil {
		reason = strings.TrimSuffix(reason, " ("+cause.Error()+")")
	}
	if !pgxReasons.MatchString(reason) {
		return ""
	}
	return reason
}

// passwordKeys are the settings whose values are secrets.
var passwordKeys = map[string]bool{"password": true, "sslpassword": true}

// doubt says why connString, which pgx parsed as c, may hold a password
// elsewhere than in its password settings (see ParseConfig), or "".
func doubt(connString string, c *pgconn.Config) string {
	if isURI(connString) {
		p := connString[strings.Index(connString, "://")+3:]
		n := strings.Count(p, "@")
		if n > 1 || n == 1 && p[strings.IndexAny(p, "@/")] == '/' {
			return "an '@' outside its user and password (write a '/' or '@' in a password as %2F or %40, and any other '@' as %40)"
		}
	} else {
		for _, name := range append(servers(c), c.User, c.Database) {
			if strings.Contains(name, "'") {
				return "a quote in a host, user or database name (quote a value that holds a quote, and escape the quote: password='it\\'s')"
			}
		}
	}
	for k := range c.RuntimeParams {
		if passwordKeys[strings.ToLower(k)] && !passwordKeys[k] {
			return "a password setting spelt with capitals (write password= or sslpassword=)"
		}
	}
	return ""
}

func isURI(s string) bool {
	return strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://")
}

// uri is a connection URI split as pgx splits it, every part as written.
type uri struct {
	scheme      string // "postgres://" or "postgresql://"
	userinfo    bool   // an '@' ends a userinfo
	user        string
	hasPassword bool // a ':' in the userinfo
	password    string
	netloc      string // hosts and ports
	hasPath     bool
	path        string // after the '/'
	hasQuery    bool
	query       string // after the '?'
}

var errUnterminatedIPv6 = errors.New(`no "]" closes an IPv6 host address`)

// splitURI splits s like pgx's URI parser: the userinfo ends at the first
// '@' before any '/', even an '@' that looks like part of a query; the host
// list ends at the first '/' or '?' outside an IPv6 address in brackets.
func splitURI(s string) (uri, error) {
	var u uri
	u.scheme = "postgresql://"
	p, ok := strings.CutPrefix(s, u.scheme)
	if !ok {
		u.scheme = "postgres://"
		p, _ = strings.CutPrefix(s, u.scheme)
	}
	if i := strings.IndexAny(p, "@/"); i >= 0 && p[i] == '@' {
		u.userinfo = true
		u.user, u.password, u.hasPassword = strings.Cut(p[:i], ":")
		p = p[i+1:]
	}
	end, err := netlocEnd(p)
	if err != nil {
		return uri{}, err
	}
	u.netloc, p = p[:end], p[end:]
	if rest, ok := strings.CutPrefix(p, "/"); ok {
		u.hasPath = true
		u.path, u.query, u.hasQuery = strings.Cut(rest, "?")
	} else if rest, ok := strings.CutPrefix(p, "?"); ok {
		u.hasQuery, u.query = true, rest
	}
	return u, nil
}

// netlocEnd returns where the comma-separated host[:port] list at the start
// of p ends.
func netlocEnd(p string) (int, error) {
	i := 0
	for {
		if i < len(p) && p[i] == '[' {
			j := strings.IndexByte(p[i:], ']')
			if j < 0 {
				return 0, errUnterminatedIPv6
			}
			i += j + 1
		}
		for i < len(p) && p[i] != '/' && p[i] != '?' && p[i] != ',' {
			i++
		}
		if i < len(p) && p[i] == ',' {
			i++
			continue
		}
		return i, nil
	}
}

func (u uri) String() string {
	var b strings.Builder
	b.WriteString(u.scheme)
	if u.userinfo {
		b.WriteString(u.user)
		if u.hasPassword {
			b.WriteString(":" + u.password)
		}
		b.WriteByte('@')
	}
	b.WriteString(u.netloc)
	if u.hasPath {
		b.WriteString("/" + u.path)
	}
	if u.hasQuery {
		b.WriteString("?" + u.query)
	}
	return b.String()
}

// kvEscape quotes v as a keyword/value string value.
func kvEscape(v string) string {
	v = strings.ReplaceAll(v, `\`, `\\`)
	v = strings.ReplaceAll(v, `'`, `\'`)
	return "'" + v + "'"
}

// WithDatabase returns connString, a libpq URL or keyword/value string,
// pointing at database name and no other. Every place the string names a
// database is rewritten: a URL's path, and its dbname= and database= query
// parameters (each occurrence, however its key is percent-encoded; pgx
// lets a parameter override the path); a keyword/value string's dbname= and
// database= settings. Everything else stays as written, a password's
// encoding included. A URL it cannot split fails with ErrUnparseable,
// quoting none of it.
func WithDatabase(connString, name string) (string, error) {
	if !isURI(connString) {
		kept, err := withoutKeywords(connString, databaseKeys)
		if err != nil {
			return "", &unparseableError{size: len(connString)}
		}
		return strings.TrimSpace(kept + " dbname=" + kvEscape(name)), nil
	}
	u, err := splitURI(connString)
	if err != nil {
		return "", &unparseableError{size: len(connString)}
	}
	u.hasPath, u.path = true, url.PathEscape(name)
	if u.hasQuery {
		var kept []string
		for _, pair := range strings.Split(u.query, "&") {
			rawKey, _, _ := strings.Cut(pair, "=")
			key, err := url.PathUnescape(rawKey)
			if err != nil {
				return "", &unparseableError{size: len(connString)}
			}
			if !databaseKeys[strings.Trim(key, " ")] {
				kept = append(kept, pair)
			}
		}
		u.query = strings.Join(kept, "&")
		u.hasQuery = len(kept) > 0
	}
	return u.String(), nil
}

// databaseKeys are the settings that name the database: libpq's keyword
// and pgx's own spelling, which pgx also takes.
var databaseKeys = map[string]bool{"dbname": true, "database": true}

// kvSpace is the white space that separates keyword/value settings.
const kvSpace = " \t\n\r\v\f"

// withoutKeywords returns the keyword/value string s without its settings
// whose keywords are in drop, the others kept as written. It reads s as pgx
// does: a keyword, an '=' (white space around it allowed), then a value, in
// single quotes or not, a backslash escaping the character after it.
func withoutKeywords(s string, drop map[string]bool) (string, error) {
	var kept []string
	rest := strings.TrimLeft(s, kvSpace)
	for rest != "" {
		eq := strings.IndexByte(rest, '=')
		if eq < 0 {
			return "", errors.New("a setting without '='")
		}
		key := strings.Trim(rest[:eq], kvSpace)
		i := eq + 1
		for i < len(rest) && strings.IndexByte(kvSpace, rest[i]) >= 0 {
			i++
		}
		if i < len(rest) && rest[i] == '\'' {
			i++
			for ; i < len(rest) && rest[i] != '\''; i++ {
				if rest[i] == '\\' {
					i++
				}
			}
			if i >= len(rest) {
				return "", errors.New("an unterminated quoted value")
			}
			i++ // the closing quote
		} else {
			for ; i < len(rest) && strings.IndexByte(kvSpace, rest[i]) < 0; i++ {
				if rest[i] == '\\' {
					i++
				}
			}
			i = min(i, len(rest)) // a trailing backslash
		}
		if !drop[key] {
			kept = append(kept, rest[:i])
		}
		rest = strings.TrimLeft(rest[i:], kvSpace)
	}
	return strings.Join(kept, " "), nil
}
