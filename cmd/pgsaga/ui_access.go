package main

// Who may use the web view, and from where: the listening address, the
// host names it answers to, the login, the origin of a button press, and
// what a request may hold.

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/pgsaga/pgsaga/internal/termsafe"
)

// The environment variables that give the web view its login. A secret is
// never a flag: every user of the machine can read a command line.
const (
	envUIToken        = "PGSAGA_UI_TOKEN"
	envUITokenFile    = "PGSAGA_UI_TOKEN_FILE"
	envUIUser         = "PGSAGA_UI_USER"
	envUIPassword     = "PGSAGA_UI_PASSWORD"
	envUIPasswordFile = "PGSAGA_UI_PASSWORD_FILE"
)

const (
	// minSecret is the fewest characters a password or token may have:
	// nothing slows down guessing.
	minSecret = 16
	// maxSecretFile bounds what a secret file may hold.
	maxSecretFile = 4096
	// uiRealm names the protection space in a challenge.
	uiRealm = "pgsaga ui"
)

// uiAuth is the web view's login: a user and password (HTTP basic
// authentication), a bearer token, or both, either of which lets a request
// in. It keeps their SHA-256 digests, which it compares in constant time.
type uiAuth struct {
	basic          bool
	user, password [sha256.Size]byte
	bearer         bool
	token          [sha256.Size]byte
}

// uiAuthFromEnv reads the login from the environment (getenv): nil if none
// is configured; an error, which never holds a secret, if one cannot be
// used.
func uiAuthFromEnv(getenv func(string) string) (*uiAuth, error) {
	token, tokenFrom, err := secretFrom(getenv, envUIToken, envUITokenFile)
	if err != nil {
		return nil, err
	}
	password, passwordFrom, err := secretFrom(getenv, envUIPassword, envUIPasswordFile)
	if err != nil {
		return nil, err
	}
	user := getenv(envUIUser)
	var a uiAuth
	switch {
	case user != "" && password == "":
		return nil, fmt.Errorf("%s needs %s or %s", envUIUser, envUIPassword, envUIPasswordFile)
	case user == "" && password != "":
		return nil, fmt.Errorf("%s needs %s, the user to log in as", passwordFrom, envUIUser)
	case user != "":
		if strings.Contains(user, ":") {
			return nil, fmt.Errorf("%s must not hold a colon", envUIUser)
		}
		if err := checkSecret(envUIUser, user, 1); err != nil {
			return nil, err
		}
		if err := checkSecret(passwordFrom, password, minSecret); err != nil {
			return nil, err
		}
		if err := checkStrength(passwordFrom, password); err != nil {
			return nil, err
		}
		a.basic, a.user, a.password = true, sha256.Sum256([]byte(user)), sha256.Sum256([]byte(password))
	}
	if token != "" {
		if err := checkSecret(tokenFrom, token, minSecret); err != nil {
			return nil, err
		}
		for _, c := range []byte(token) {
			if c <= ' ' || c >= 0x7f {
				return nil, fmt.Errorf("%s may hold only visible ASCII characters (no spaces)", tokenFrom)
			}
		}
		if err := checkStrength(tokenFrom, token); err != nil {
			return nil, err
		}
		a.bearer, a.token = true, sha256.Sum256([]byte(token))
	}
	if !a.basic && !a.bearer {
		return nil, nil
	}
	return &a, nil
}

// secretFrom is the secret the variable name gives, or the file fileName
// names ("" if neither is set), and which of the two gave it.
func secretFrom(getenv func(string) string, name, fileName string) (secret, from string, err error) {
	value, path := getenv(name), getenv(fileName)
	switch {
	case value != "" && path != "":
		return "", "", fmt.Errorf("set %s or %s, not both", name, fileName)
	case path != "":
		secret, err := readSecretFile(fileName, path)
		return secret, fileName, err
	}
	return value, name, nil
}

// readSecretFile reads the secret in the file at path (named by the
// variable name), without the line end it may have. It refuses a file that
// every user of the machine may read or write (as ssh refuses a private key,
// and libpq a password file): whoever can read it has the login, and
// whoever can write it can choose it.
func readSecretFile(name, path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	if !info.Mode().IsRegular() {
		return "", fmt.Errorf("%s %s is not a regular file", name, path)
	}
	if perm := info.Mode().Perm(); perm&0o007 != 0 {
		return "", fmt.Errorf("%s %s may be read or written by every user of this machine (mode %04o): chmod o-rwx it", name, path, perm)
	}
	raw, err := io.ReadAll(io.LimitReader(f, maxSecretFile+1))
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	if len(raw) > maxSecretFile {
		return "", fmt.Errorf("%s %s is longer than %d bytes: it must hold the secret alone", name, path, maxSecretFile)
	}
	s := strings.TrimSuffix(strings.TrimSuffix(string(raw), "\n"), "\r")
	if s == "" {
		return "", fmt.Errorf("%s %s is empty", name, path)
	}
	return s, nil
}

// checkSecret says what is wrong with the value of the variable name, if
// anything, without saying the value.
func checkSecret(name, value string, minLen int) error {
	switch {
	case !utf8.ValidString(value):
		return fmt.Errorf("%s is not UTF-8 text", name)
	case !termsafe.Clean(value):
		return fmt.Errorf("%s holds a control character", name)
	case utf8.RuneCountInString(value) < minLen:
		return fmt.Errorf("%s is too short: at least %d characters", name, minLen)
	}
	return nil
}

// Strength rules of a password or token, beyond minSecret characters.
const (
	// minDistinct is the fewest different characters a secret may hold.
	minDistinct = 6
	// minOneKind is the fewest characters of a secret of one kind of
	// character only (digits, lower-case or upper-case letters).
	minOneKind = 24
)

// makeSecret says how to make a good secret, for messages.
const makeSecret = "make one with `openssl rand -hex 32`"

// errWeakSecret is what checkStrength's errors wrap.
var errWeakSecret = errors.New("too weak")

// checkStrength says what makes the secret value of the variable name easy
// to guess, if anything, without saying the value: too few different
// characters, a short string repeated, a run of neighbouring characters
// (0123…, abcd…, fedc…) for most of it, or one kind of character only
// (all digits, all lower-case letters, …) in fewer than minOneKind. A
// random secret of minSecret characters or more (openssl rand -hex 8 or
// longer) passes.
func checkStrength(name, value string) error {
	rs := []rune(value)
	weak := func(why string) error {
		return fmt.Errorf("%s is %w: %s; %s", name, errWeakSecret, why, makeSecret)
	}
	distinct := map[rune]bool{}
	kinds := map[int]bool{}
	for _, r := range rs {
		distinct[r] = true
		kinds[runeKind(r)] = true
	}
	if len(distinct) < minDistinct {
		return weak(fmt.Sprintf("it holds fewer than %d different characters", minDistinct))
	}
	for p := 1; p <= len(rs)/2; p++ {
		if periodic(rs, p) {
			return weak("it repeats a shorter string")
		}
	}
	steps := 0
	for i := 1; i < len(rs); i++ {
		if d := rs[i] - rs[i-1]; d == 1 || d == -1 || d == 0 {
			steps++
		}
	}
	if 2*steps >= len(rs)-1 {
		return weak("most of it runs through neighbouring characters, like 0123 or abcd")
	}
	if len(kinds) == 1 && len(rs) < minOneKind {
		return weak(fmt.Sprintf("it holds one kind of character only (all digits, or all letters of one case): mix them or give at least %d characters", minOneKind))
	}
	return nil
}

// periodic reports whether rs repeats its first p runes throughout.
func periodic(rs []rune, p int) bool {
	for i := p; i < len(rs); i++ {
		if rs[i] != rs[i-p] {
			return false
		}
	}
	return true
}

// runeKind is the kind of r: a digit, a lower-case letter, an upper-case
// letter, or anything else.
func runeKind(r rune) int {
	switch {
	case unicode.IsDigit(r):
		return 0
	case unicode.IsLower(r):
		return 1
	case unicode.IsUpper(r):
		return 2
	}
	return 3
}

// allows reports whether r carries the login.
func (a *uiAuth) allows(r *http.Request) bool {
	scheme, cred, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	switch {
	case a.basic && strings.EqualFold(scheme, "Basic"):
		raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
		if err != nil {
			return false
		}
		user, password, ok := strings.Cut(string(raw), ":")
		u, p := sha256.Sum256([]byte(user)), sha256.Sum256([]byte(password))
		return ok && subtle.ConstantTimeCompare(u[:], a.user[:])&subtle.ConstantTimeCompare(p[:], a.password[:]) == 1
	case a.bearer && strings.EqualFold(scheme, "Bearer"):
		t := sha256.Sum256([]byte(strings.TrimSpace(cred)))
		return subtle.ConstantTimeCompare(t[:], a.token[:]) == 1
	}
	return false
}

// checkAuth answers 401, with a challenge for each way to log in, a
// request without the login, if one is configured. A client that failed
// too many logins lately (see loginThrottle) is answered 429, with a
// Retry-After, before its credential is looked at: a guess throttled
// learns nothing, not even a right one. Refusals are logged a line a
// minute at most (loginGuard.refusal).
func (u *webUI) checkAuth(next http.Handler) http.Handler {
	a := u.cfg.Auth
	if a == nil {
		return next
	}
	g := u.logins
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := clientKey(r)
		kind := credentialKind(r)
		attrs := []any{"method", r.Method, "path", r.URL.Path, "credential", kind, "remote", r.RemoteAddr}
		if wait := g.admit(key); wait > 0 {
			g.refusal(key, true, attrs...)
			tooManyLogins(w, wait)
			return
		}
		if a.allows(r) {
			g.loggedIn(key)
			next.ServeHTTP(w, r)
			return
		}
		if kind != "none" { // no credential guesses nothing: the browser's first request
			g.failed(key)
		}
		if a.basic {
			w.Header().Add("WWW-Authenticate", `Basic realm="`+uiRealm+`", charset="UTF-8"`)
		}
		if a.bearer {
			w.Header().Add("WWW-Authenticate", `Bearer realm="`+uiRealm+`"`)
		}
		g.refusal(key, false, attrs...)
		plainError(w, http.StatusUnauthorized, "pgsaga ui: log in first.")
	})
}

// credentialKind is the kind of credential r carries, for the log: none,
// basic, bearer or other (never any of the header itself, which may be a
// secret sent without its scheme).
func credentialKind(r *http.Request) string {
	h := r.Header.Get("Authorization")
	scheme, _, _ := strings.Cut(h, " ")
	switch {
	case h == "":
		return "none"
	case strings.EqualFold(scheme, "Basic"):
		return "basic"
	case strings.EqualFold(scheme, "Bearer"):
		return "bearer"
	}
	return "other"
}

// plainError answers a request refused before it may see anything of the
// database: a line of text, not a page (which says where the database is).
func plainError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, termsafe.Text(msg)+"\n")
}

// --- the address and the host names -----------------------------------------

// checkAddr says what is wrong with a listening address, if anything.
func checkAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--addr %q: want host:port, like 127.0.0.1:8080", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("--addr %q: the port must be a number from 0 to 65535", addr)
	}
	if host != "" && net.ParseIP(host) == nil && !hostName(host) {
		return fmt.Errorf("--addr %q: %q is neither an IP address nor a host name", addr, host)
	}
	return nil
}

// hostName reports whether s is a syntactically valid DNS name: not an IP
// address, so its last label is not a number (999.1.1.1 is neither).
func hostName(s string) bool {
	if len(s) > 253 {
		return false
	}
	labels := strings.Split(s, ".")
	if _, err := strconv.Atoi(labels[len(labels)-1]); err == nil {
		return false
	}
	for _, label := range labels {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// checkAllowHost is an --allow-host value as Host headers and origins
// write it (lower case, an IPv6 address in brackets), or what is wrong
// with it.
func checkAllowHost(s string) (string, error) {
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("--allow-host %q: %s; want a host name or IP address, optionally with :port, like ui.example.com or ui.example.com:8443", s, why)
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		host, port = strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"), ""
	} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return bad("the port must be a number from 1 to 65535")
	}
	host = strings.ToLower(host)
	switch ip := net.ParseIP(host); {
	case ip != nil && strings.Contains(host, ":"):
		host = "[" + host + "]"
	case ip == nil && !hostName(host):
		return bad("not a host name")
	}
	if port != "" {
		return host + ":" + port, nil
	}
	return host, nil
}

// loopbackAddr reports whether the listening address addr is on the
// loopback interface only: 127.0.0.0/8, ::1 or localhost. Anything else
// (0.0.0.0, ::, another address, another host name) can be reached from
// other machines.
func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// exposedWithout says what a server on addr lacks to be reached from other
// machines, if anything: a login and the host names it serves.
func exposedWithout(addr string, auth *uiAuth, allow []string) error {
	if loopbackAddr(addr) {
		return nil
	}
	var missing []string
	if auth == nil {
		missing = append(missing, fmt.Sprintf("a login (set %s or %s, or %s with %s or %s)", envUIToken, envUITokenFile, envUIUser, envUIPassword, envUIPasswordFile))
	}
	if len(allow) == 0 {
		missing = append(missing, "the host names it is reached by (--allow-host NAME, once for each)")
	}
	if missing == nil {
		return nil
	}
	return fmt.Errorf("--addr %s can be reached from other machines, so the web view needs %s; or listen on 127.0.0.1", addr, strings.Join(missing, " and "))
}

// allowedHosts is the Host headers (and origins' hosts) a server
// listening on bound answers to, lower case. On loopback, the machine's
// own names for it with its port (a page of another site whose name was
// pointed at 127.0.0.1, DNS rebinding, gets nothing), and without one on
// port 80. Then the names allow gives (checkAllowHost): one with a port on
// that port; one without on the port it listens on, and with none (behind
// a proxy on the default port).
func allowedHosts(loopback bool, flagAddr string, bound net.Addr, allow []string) []string {
	port := "0"
	var names []string
	if loopback {
		names = []string{"localhost", "127.0.0.1", "::1"}
	}
	if tcp, ok := bound.(*net.TCPAddr); ok {
		port = strconv.Itoa(tcp.Port)
		if loopback {
			names = append(names, tcp.IP.String())
		}
	}
	if h, _, err := net.SplitHostPort(flagAddr); err == nil && h != "" && loopback {
		names = append(names, h)
	}
	var out []string
	add := func(hosts ...string) {
		for _, h := range hosts {
			if !slices.Contains(out, h) {
				out = append(out, h)
			}
		}
	}
	for _, n := range names {
		h := strings.ToLower(net.JoinHostPort(n, port))
		add(h)
		if port == "80" {
			add(strings.TrimSuffix(h, ":80"))
		}
	}
	for _, a := range allow {
		if _, _, err := net.SplitHostPort(a); err == nil {
			add(a)
		} else {
			add(a+":"+port, a)
		}
	}
	return out
}

// --- what a request may hold ------------------------------------------------
