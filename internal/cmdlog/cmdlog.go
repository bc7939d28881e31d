// Package cmdlog holds the logging flags pgsaga's programs share (-v,
// -log-level, -log-format) and builds the logger they describe. Log records
// go to stderr; what a program prints of its own (progress, its report) is
// not a log record and keeps its form.
package cmdlog

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
)

// Formats of -log-format.
const (
	FormatText = "text" // key=value pairs, one record a line (slog's text handler)
	FormatJSON = "json" // one JSON object a line (slog's JSON handler)
)

// Flags are the logging flags. Their names are a contract.
type Flags struct {
	// Verbose is -v: log at Info and above.
	Verbose bool
	// Level is -log-level as given ("" when it was not).
	Level string
	// Format is -log-format: FormatText or FormatJSON.
	Format string

	level    slog.Level
	levelSet bool
}

// Register adds -v, -log-level and -log-format to fs; defaultLevel names
// the program's default level in -h, e.g. "warn".
func (f *Flags) Register(fs *flag.FlagSet, defaultLevel string) {
	fs.BoolVar(&f.Verbose, "v", false, "log what the workers do, at info and above (to stderr); short for -log-level info")
	fs.StringVar(&f.Level, "log-level", "", "log records at this level and above: debug (Watermill's router chatter included), info, warn or error; default "+defaultLevel+", info with -v")
	fs.StringVar(&f.Format, "log-format", FormatText, "log records as text (key=value) or json (one object a line), on stderr")
}

// Validate checks the flags once fs has parsed them.
func (f *Flags) Validate(fs *flag.FlagSet) error {
	switch f.Format {
	case FormatText, FormatJSON:
	default:
		return fmt.Errorf("-log-format must be text or json, got %q", f.Format)
	}
	set := false
	fs.Visit(func(fl *flag.Flag) { set = set || fl.Name == "log-level" })
	if !set {
		return nil
	}
	if f.Verbose {
		return errors.New("-v is short for -log-level info: give one of them")
	}
	l, err := ParseLevel(f.Level)
	if err != nil {
		return err
	}
	f.level, f.levelSet = l, true
	return nil
}

// ParseLevel reads a level name: debug, info, warn or error (any case).
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "debug":
		return slog.LevelDebug, nil
	case "info":
		return slog.LevelInfo, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("-log-level must be debug, info, warn or error, got %q", s)
}

// LevelOr is the level the flags ask for: -log-level, else info with -v,
// else def (the program's default, which may depend on its other flags).
func (f *Flags) LevelOr(def slog.Level) slog.Level {
	switch {
	case f.levelSet:
		return f.level
	case f.Verbose:
		return slog.LevelInfo
	}
	return def
}

// New returns a logger of records at level and above, written to w in the
// format the flags ask for.
func (f *Flags) New(w io.Writer, level slog.Level) *slog.Logger {
	return New(w, f.Format, level)
}

// New returns a logger of records at level and above, written to w as
// format (FormatText, or FormatJSON; anything else is text).
func New(w io.Writer, format string, level slog.Level) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == FormatJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// Synced returns w with its writes serialized: a program's progress lines
// and its workers' log records share stderr, and a writer that is not an
// *os.File (a test's buffer) must not see them at once.
func Synced(w io.Writer) io.Writer {
	if s, ok := w.(*syncWriter); ok {
		return s
	}
	return &syncWriter{w: w}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
