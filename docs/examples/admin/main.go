// Command admin is a team's admin server that mounts pgsaga's web view
// (saga/sagaui) under /admin/sagas/, behind its own login: an operator
// signs in at /login with ADMIN_PASSWORD and gets a session cookie; the
// view sees only requests that carry one.
//
//	DATABASE_URL=postgres://… ADMIN_PASSWORD=… go run .
package main

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"html"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/sagaui"
)

func main() {
	password := os.Getenv("ADMIN_PASSWORD")
	if len(password) < 16 {
		log.Fatal("ADMIN_PASSWORD must be at least 16 characters")
	}
	pool, err := pgxpool.New(context.Background(), os.Getenv("DATABASE_URL"))
	check(err)
	client, err := saga.NewClient(pool, saga.ClientConfig{Logger: slog.New(slog.DiscardHandler)}) // never started: the view reads and asks
	check(err)
	ui, err := sagaui.New(sagaui.Config{Client: client, Prefix: "/admin/sagas"})
	check(err)

	s := &sessions{password: password, live: map[string]bool{}}
	mux := http.NewServeMux()
	mux.Handle("/admin/sagas/", s.require(ui))
	mux.HandleFunc("GET /login", s.form)
	mux.HandleFunc("POST /login", s.login)

	addr := os.Getenv("ADMIN_ADDR")
	if addr == "" {
		addr = "127.0.0.1:8081"
	}
	ln, err := net.Listen("tcp", addr)
	check(err)
	fmt.Printf("admin: serving http://%s/admin/sagas/\n", ln.Addr())
	check(http.Serve(ln, mux))
}

// sessions is the team's own login: a password, then a random session
// token in a cookie.
type sessions struct {
	password string
	mu       sync.Mutex
	live     map[string]bool
}

// require lets through only requests with a live session; others are
// sent to the login page.
func (s *sessions) require(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := r.Cookie("admin_session")
		s.mu.Lock()
		ok := err == nil && s.live[c.Value]
		s.mu.Unlock()
		if !ok {
			http.Redirect(w, r, "/login", http.StatusSeeOther)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *sessions) form(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	fmt.Fprint(w, `<!doctype html><title>Sign in</title><form method="post" action="/login">`+
		`<input type="password" name="password" id="password"><button id="sign-in">Sign in</button></form>`)
}

func (s *sessions) login(w http.ResponseWriter, r *http.Request) {
	if subtle.ConstantTimeCompare([]byte(r.PostFormValue("password")), []byte(s.password)) != 1 {
		http.Error(w, html.EscapeString("wrong password"), http.StatusUnauthorized)
		return
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	token := hex.EncodeToString(b)
	s.mu.Lock()
	s.live[token] = true
	s.mu.Unlock()
	http.SetCookie(w, &http.Cookie{Name: "admin_session", Value: token, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/admin/sagas/", http.StatusSeeOther)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
