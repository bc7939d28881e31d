package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/pgsaga/pgsaga/internal/cmdlog"
	"github.com/pgsaga/pgsaga/internal/obs"
)

// serveFlags are the flags of the commands that run until stopped (relay,
// ui): their logs, their metrics. Their traces come from the standard
// OpenTelemetry environment (see obs.Tracing). The names are a contract.
type serveFlags struct {
	verbose       bool
	level         string
	format        string
	metricsAddr   string
	metricsPublic bool
}

// register adds --verbose (-v), --log-level, --log-format and
// --metrics-addr to fs; verbose says what -v logs.
func (f *serveFlags) register(fs *pflag.FlagSet, verbose string) {
	fs.BoolVarP(&f.verbose, "verbose", "v", false, verbose+" (short for --log-level debug)")
	fs.StringVar(&f.level, "log-level", "", "log records at this level and above, on stderr: debug, info, warn or error (default info)")
	fs.StringVar(&f.format, "log-format", cmdlog.FormatText, "log records as text (key=value) or json (one object a line)")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9090 (port 0 picks one; printed on stderr); default: none")
	fs.BoolVar(&f.metricsPublic, "metrics-public", false, "let --metrics-addr be off loopback: the metrics (saga names, topics, consumer groups) are then served to anyone who can reach it, with no login")
}

// logger checks the flags and returns the logger they ask for, writing to
// w; a bad value is a usage error.
func (f *serveFlags) logger(fs *pflag.FlagSet, w io.Writer) (*slog.Logger, error) {
	switch f.format {
	case cmdlog.FormatText, cmdlog.FormatJSON:
	default:
		return nil, usagef("--log-format must be text or json, got %q", f.format)
	}
	level := slog.LevelInfo
	if f.verbose {
		level = slog.LevelDebug
	}
	if fs.Changed("log-level") {
		if f.verbose {
			return nil, usagef("-v is short for --log-level debug: give one of them")
		}
		l, err := cmdlog.ParseLevel(f.level)
		if err != nil {
			return nil, usageError{err}
		}
		level = l
	}
	if f.metricsAddr != "" {
		if err := obs.CheckMetricsAddr(f.metricsAddr); err != nil {
			return nil, usagef("--metrics-addr %q: want host:port, e.g. 127.0.0.1:9090", f.metricsAddr)
		}
		if !loopbackAddr(f.metricsAddr) && !f.metricsPublic {
			return nil, usagef("--metrics-addr %q is off loopback, where the metrics are served without a login: "+
				"give --metrics-public to mean it, or scrape through a proxy that authenticates", f.metricsAddr)
		}
	}
	return cmdlog.New(w, f.format, level), nil
}

// serve starts what the flags ask for besides logs: traces from the
// environment (named service), and, with --metrics-addr, a metrics server
// announced on stderr whose registry it returns (nil without), for the
// command to register its collectors in. stop ends both.
func (f *serveFlags) serve(ctx context.Context, service string, stderr io.Writer, log *slog.Logger) (reg *prometheus.Registry, stop func(), err error) {
	stopTracing, err := obs.Tracing(ctx, "pgsaga-"+service, stderr)
	if err != nil {
		return nil, nil, err
	}
	stopTraces := func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := stopTracing(sctx); err != nil {
			log.Warn("flushing traces failed", "err", err)
		}
	}
	if f.metricsAddr == "" {
		return nil, stopTraces, nil
	}
	reg = obs.NewRegistry()
	srv, err := obs.ServeMetrics(f.metricsAddr, reg, log)
	if err != nil {
		stopTraces()
		return nil, nil, err
	}
	fmt.Fprintf(stderr, "pgsaga %s: metrics at http://%s/metrics\n", service, srv.Addr())
	return reg, func() {
		_ = srv.Close()
		stopTraces()
	}, nil
}

// registerer is reg as a prometheus.Registerer, nil (none) for no reg.
func registerer(reg *prometheus.Registry) prometheus.Registerer {
	if reg == nil {
		return nil
	}
	return reg
}
