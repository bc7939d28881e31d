package pgdb

import (
	"errors"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// mask replaces every password Redact finds.
const mask = "xxxxx"

// Unreadable is what Redact returns for a connection string pgx cannot
// split into its parts: where a password ends in it is anybody's guess, so
// none of it is shown.
const Unreadable = "[connection string hidden: it does not parse]"

// passwordKeys are the settings whose values are secrets.
var passwordKeys = map[string]bool{"password": true, "sslpassword": true}

// Redact returns connString, a libpq URL or keyword/value string, with every
// password in it masked, so it can be printed or logged: the URL's userinfo
// password, password= and sslpassword= query parameters, and password= and
// sslpassword= keyword values, quoted or not. The rest of the string is
// left as written.
//
// It splits the string the way pgx (and libpq) does, masks, then has pgx
// itself read the result: if pgx still finds a password other than the
// mask there, or the string cannot be split, it returns Unreadable.
func Redact(connString string) string {
	var (
		out string
		err error
	)
	if isURI(connString) {
		out, err = redactURI(connString)
	} else {
		out, err = redactKeywordValue(connString)
	}
	if err != nil || missedPassword(out) {
		return Unreadable
	}
	return out
}

func isURI(s string) bool {
	return strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://")
}

// decoy is a password that missedPassword gives a masked string where it
// holds none, so that pgx does not fill one in from PGPASSWORD or the
// password file.
const decoy = "pgdb-redact-decoy"

// missedPassword reports whether pgx reads from masked a password other
// than the mask (or the decoy): a position the masking missed. Strings pgx
// rejects for another reason (a bad port, say) cannot be checked; the
// split, which mirrors pgx's, stands alone for them.
func missedPassword(masked string) bool {
	probe := "password=" + decoy + " " + masked // a later setting wins
	if isURI(masked) {
		u, err := splitURI(masked)
		if err != nil {
			return true
		}
		if u.password == "" { // else a masked one, which the query may override
			u.userinfo, u.hasPassword, u.password = true, true, decoy
		}
		probe = u.String()
	}
	cfg, err := pgconn.ParseConfig(probe)
	if err != nil {
		return false
	}
	return cfg.Password != mask && cfg.Password != decoy
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

func redactURI(s string) (string, error) {
	u, err := splitURI(s)
	if err != nil {
		return "", err
	}
	if u.password != "" { // pgx ignores an empty one
		u.password = mask
	}
	if u.hasQuery {
		pairs := strings.Split(u.query, "&")
		for i, pair := range pairs {
			key, _, hasValue := strings.Cut(pair, "=")
			if hasValue && passwordKeys[decodeQueryKey(key)] {
				pairs[i] = key + "=" + mask
			}
		}
		u.query = strings.Join(pairs, "&")
	}
	return u.String(), nil
}

// decodeQueryKey decodes a query key as pgx does: spaces trimmed, %XX
// decoded, anything else as is.
func decodeQueryKey(raw string) string {
	raw = strings.Trim(raw, " ")
	if k, err := url.PathUnescape(raw); err == nil {
		return k
	}
	return raw
}

// kvToken is one keyword=value setting of a keyword/value string: the
// keyword, and where its value, quotes included, starts and ends.
type kvToken struct {
	key        string
	start, end int
}

var errKeywordValue = errors.New("not a keyword/value connection string")

// splitKeywordValue splits s like pgx's keyword/value parser (libpq's
// rules): keyword, optional spaces, '=', optional spaces, then a value that
// is either a run of non-spaces or a single-quoted string, a backslash
// escaping the next character in both.
func splitKeywordValue(s string) ([]kvToken, error) {
	var toks []kvToken
	i := skipSpace(s, 0)
	for i < len(s) {
		eq := strings.IndexByte(s[i:], '=')
		if eq < 0 {
			return nil, errKeywordValue
		}
		key := strings.TrimRight(s[i:i+eq], " \t\n\r\v\f")
		if key == "" || strings.ContainsAny(key, " \t\n\r\v\f") {
			return nil, errKeywordValue
		}
		i = skipSpace(s, i+eq+1)
		start := i
		if i < len(s) && s[i] == '\'' {
			end, ok := quotedEnd(s, i+1)
			if !ok {
				return nil, errKeywordValue
			}
			i = end + 1
		} else {
			for i < len(s) && !isSpace(s[i]) {
				if s[i] == '\\' {
					i++
				}
				i++
			}
			i = min(i, len(s))
		}
		toks = append(toks, kvToken{key: key, start: start, end: i})
		i = skipSpace(s, i)
	}
	return toks, nil
}

// quotedEnd returns the index of the quote that closes the quoted value
// whose text starts at i.
func quotedEnd(s string, i int) (int, bool) {
	for ; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '\'':
			return i, true
		}
	}
	return 0, false
}

func skipSpace(s string, i int) int {
	for i < len(s) && isSpace(s[i]) {
		i++
	}
	return i
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'
}

func redactKeywordValue(s string) (string, error) {
	toks, err := splitKeywordValue(s)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	last := 0
	for _, t := range toks {
		if !passwordKeys[t.key] {
			continue
		}
		b.WriteString(s[last:t.start])
		b.WriteString(mask)
		last = t.end
	}
	b.WriteString(s[last:])
	return b.String(), nil
}

// kvEscape quotes v as a keyword/value string value.
func kvEscape(v string) string {
	v = strings.ReplaceAll(v, `\`, `\\`)
	v = strings.ReplaceAll(v, `'`, `\'`)
	return "'" + v + "'"
}

// redactParseError makes pgx's error about a connection string it could
// not parse quote the string as Redact does: pgx masks passwords on a
// best-effort basis only (it shows the end of a quoted password holding an
// escaped quote, for one). It stays a *pgconn.ParseConfigError.
func redactParseError(err error, connString string) error {
	var pce *pgconn.ParseConfigError
	if !errors.As(err, &pce) {
		return err
	}
	redacted := *pce
	redacted.ConnString = Redact(connString)
	return &redacted
}
