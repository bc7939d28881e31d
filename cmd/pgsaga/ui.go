package main

// `pgsaga ui`: the operator's web view. Server-rendered pages (html/template,
// templates and CSS embedded), no script at all, nothing loaded from
// elsewhere. The pages read what the other subcommands read, through the
// same code; the buttons ask for what `retry`, `cancel` and
// `dead-letters replay` ask for.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/saga/sagaui"
)

func uiCmd() *cobra.Command {
	var (
		addr    string
		allow   []string
		serving serveFlags
	)
	cmd := &cobra.Command{
		Use:   "ui",
		Short: "Serve the operator's web view: sagas, a saga's timeline, dead letters, consumer groups",
		Long: "ui serves web pages over the database the other commands read, until SIGINT or SIGTERM: the sagas by status, " +
			"a saga's timeline drawn as a picture with Retry and Cancel buttons, the dead letters with a Replay button each, " +
			"and every consumer group. It listens on the loopback interface unless --addr says otherwise, answers only to " +
			"its host names (there, the local ones), and refuses a button press that comes from another site. Elsewhere it needs " +
			"a login (" + envUIToken + " or " + envUITokenFile + ", or " + envUIUser + " with " + envUIPassword + " or " +
			envUIPasswordFile + "; on loopback it is optional) and the host names it is reached by (--allow-host). " +
			"A token or password must be hard to guess (at least 16 characters, 6 different ones, not repeated, not a run like " +
			"0123 or abcd, not of one kind only under 24): make one with `openssl rand -hex 32`. After 10 failed logins " +
			"from one address (or 100 from all), it answers 429 with a Retry-After until the address has waited (one more " +
			"try each 6s), and logs refused logins a line a minute at most.",
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkAddr(addr); err != nil {
				return usageError{err}
			}
			names := make([]string, len(allow))
			for i, a := range allow {
				n, err := checkAllowHost(a)
				if err != nil {
					return usageError{err}
				}
				names[i] = n
			}
			auth, err := uiAuthFromEnv(os.Getenv)
			if err != nil {
				return usageError{err}
			}
			if err := exposedWithout(addr, auth, names); err != nil {
				return usageError{err}
			}
			stderr := cmd.ErrOrStderr()
			log, err := serving.logger(cmd.Flags(), stderr)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			return onFound(ctx, true, commandConns, func(db *pgdb.DB, found target) error {
				reg, stop, err := serving.serve(ctx, "ui", stderr, log)
				if err != nil {
					return err
				}
				defer stop()
				if reg != nil {
					c, err := operatorClient(db.SQL, log)
					if err != nil {
						return err
					}
					reg.MustRegister(c.Collector())
				}
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					return fmt.Errorf("cannot listen on %s: %w", addr, err)
				}
				loopback := loopbackAddr(addr)
				hosts := allowedHosts(loopback, addr, ln.Addr(), names)
				if !loopback {
					fmt.Fprintf(stderr, "pgsaga ui: reachable from other machines; it answers to %s, with the login. It speaks plain HTTP: "+
						"put a proxy that speaks HTTPS in front, or the login crosses the network readable.\n", strings.Join(hosts, ", "))
				}
				h, err := newUI(uiConfig{DB: db.SQL, Logger: log, Where: found.describe(), Hosts: hosts, Auth: auth})
				if err != nil {
					_ = ln.Close()
					return err
				}
				defer h.logins.stop()
				return serveUI(ctx, ln, h, stderr, log)
			})
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8080", "host:port to listen on (port 0: any free port); off loopback it needs a login and --allow-host")
	cmd.Flags().StringArrayVar(&allow, "allow-host", nil, "a host name (or IP address, optionally with :port) the view is reached by; repeat for each")
	serving.register(cmd.Flags(), "log one line per request")
	return cmd
}

// serveUI serves h on ln until ctx ends, then shuts down gracefully:
// requests in progress finish, within 10s.
func serveUI(ctx context.Context, ln net.Listener, h http.Handler, stderr io.Writer, log *slog.Logger) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      2 * time.Minute,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	fmt.Fprintf(stderr, "pgsaga ui: serving http://%s\n", ln.Addr())
	select {
	case err := <-served:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		_ = srv.Close()
		return fmt.Errorf("shutting down: %w", err)
	}
	<-served
	fmt.Fprintln(stderr, "pgsaga ui: stopped")
	return nil
}

// uiConfig configures the command's web view: the view of package sagaui
// behind the command's host check and login.
type uiConfig struct {
	DB     *sql.DB
	Logger *slog.Logger
	// Where says where the database is, for the pages' header.
	Where string
	// Hosts are the Host headers answered, and the hosts of the origins a
	// button press may come from (allowedHosts). Required.
	Hosts []string
	// Auth is the login every request needs; nil for none.
	Auth *uiAuth
	// Logins limits failed logins (see loginThrottle). Zero: the
	// defaults.
	Logins loginThrottle
	// RequestWait is how long a Retry or Cancel waits for a worker to
	// carry the request out before the page says it is pending. Default:
	// the view's.
	RequestWait time.Duration
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// webUI is the command's web view: the host check, then the login, then
// the pages (sagaui.Handler, which checks the host again and the origin
// of every button press).
type webUI struct {
	cfg     uiConfig
	log     *slog.Logger
	logins  *loginGuard
	handler http.Handler
}

func newUI(cfg uiConfig) (*webUI, error) {
	if cfg.DB == nil || len(cfg.Hosts) == 0 {
		return nil, errors.New("ui: DB and Hosts are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	client, err := operatorClient(cfg.DB, cfg.Logger)
	if err != nil {
		return nil, err
	}
	pages, err := sagaui.New(sagaui.Config{Client: client, Hosts: cfg.Hosts, Where: cfg.Where, Logger: cfg.Logger,
		RequestWait: cfg.RequestWait, Now: cfg.Now})
	if err != nil {
		return nil, err
	}
	u := &webUI{cfg: cfg, log: cfg.Logger, logins: newLoginGuard(cfg.Logins, cfg.Now, cfg.Logger)}
	u.handler = u.checkHost(u.checkAuth(pages))
	return u, nil
}

func (u *webUI) ServeHTTP(w http.ResponseWriter, r *http.Request) { u.handler.ServeHTTP(w, r) }

// checkHost refuses a request for a host name the server does not answer
// to (see allowedHosts), before the login, saying nothing of the database:
// a page of a site whose name was pointed at this machine can read the
// answer.
func (u *webUI) checkHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if slices.Contains(u.cfg.Hosts, strings.ToLower(r.Host)) {
			next.ServeHTTP(w, r)
			return
		}
		u.log.Warn("ui: request refused", "method", r.Method, "path", r.URL.Path, "host", r.Host, "origin", r.Header.Get("Origin"),
			"sec_fetch_site", r.Header.Get("Sec-Fetch-Site"), "remote", r.RemoteAddr)
		plainError(w, http.StatusForbidden, fmt.Sprintf("pgsaga ui: this server does not answer to the host name %q (see --allow-host).", r.Host))
	})
}
