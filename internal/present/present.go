// Package present is how the operator's tools (pgsaga's commands, the
// web view in saga/sagaui) show sagas and dead letters: ages, the
// database's clock, the sagas listing's filter. One place, so the command
// line and the pages say the same.
package present

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// Age is d for people: 850ms, 12s, 5m03s, 3h20m, 2d4h.
func Age(d time.Duration) string {
	switch {
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
}

func Attempt(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

func Clip(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

func Dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// DBNow is the database's clock when in was read, which set its times
// (the local clock for an instance read without it).
func DBNow(in saga.Instance) time.Time {
	if in.ReadAt.IsZero() {
		return time.Now()
	}
	return in.ReadAt
}

// LimitError says what is wrong with a listing's limit, if anything.
func LimitError(limit int) error {
	if limit < 1 || limit > MaxLimit {
		return fmt.Errorf("limit must be between 1 and %d, got %d", MaxLimit, limit)
	}
	return nil
}

// OneLine keeps a table row on one line, whatever a detail holds.
func OneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func Plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// ReplayDeadLetter sends dead letter id back to its queue, once (the
// command's replay and the web view's), and says what it did.
func ReplayDeadLetter(ctx context.Context, c *saga.Client, id int64) (string, error) {
	n, err := c.ReplayDeadLetter(ctx, id)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("dead letter %d replayed (%d queue%s)", id, n, Plural(n)), nil
}

// SagaFilter is the filter of the sagas listing (the command's and the
// web view's), or what is wrong with it, named as the flag or form field.
func SagaFilter(status []string, name string, olderThan time.Duration, limit int) (saga.Filter, error) {
	f := saga.Filter{Type: name, OlderThan: olderThan, Limit: limit}
	if bad := transport.Unstorable(name); bad != "" {
		return saga.Filter{}, fmt.Errorf("saga: a saga's name cannot hold %s", bad)
	}
	for _, s := range status {
		st := saga.Status(s)
		if !ValidStatus(st) {
			return saga.Filter{}, fmt.Errorf("status %q: want one of %s", s, StatusList())
		}
		f.Statuses = append(f.Statuses, st)
	}
	if err := LimitError(limit); err != nil {
		return saga.Filter{}, err
	}
	if olderThan < 0 {
		return saga.Filter{}, fmt.Errorf("older-than must not be negative, got %s", olderThan)
	}
	return f, nil
}

func ValidStatus(s saga.Status) bool {
	for _, st := range Statuses {
		if s == st {
			return true
		}
	}
	return false
}

func StatusList() string {
	s := make([]string, len(Statuses))
	for i, st := range Statuses {
		s[i] = string(st)
	}
	return strings.Join(s, ", ")
}

// DeadLetterNow is the database's clock when d was read, which set its
// times (the local clock only for a dead letter read without it).
func DeadLetterNow(d delivery.DeadLetter) time.Time {
	if d.ReadAt.IsZero() {
		return time.Now()
	}
	return d.ReadAt
}

// Statuses are the statuses, in the order tools list them.
var Statuses = []saga.Status{saga.StatusRunning, saga.StatusCompensating, saga.StatusCompleted, saga.StatusCompensated, saga.StatusFailed}

// MaxLimit bounds every listing.
const MaxLimit = 10_000

// AwaitRequest waits until a worker carried req out or it was
// dead-lettered (saga.Request.Lost), or timeout; then it returns the
// request as last read (pending, with no DoneAt, after timeout). A tool's
// wait for a row: a short poll, not a worker's.
func AwaitRequest(ctx context.Context, c *saga.Client, req saga.Request, timeout time.Duration) (saga.Request, error) {
	wait, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for req.DoneAt == nil && !req.Lost() {
		got, err := c.RequestStatuses(wait, []uuid.UUID{req.ID})
		if err != nil {
			if ctx.Err() == nil && wait.Err() != nil {
				return req, nil // the time is up: reported as pending
			}
			return req, err
		}
		if r, ok := got[req.ID]; ok {
			req = r
		}
		if req.DoneAt != nil || req.Lost() {
			break
		}
		select {
		case <-wait.Done():
			if ctx.Err() != nil {
				return req, ctx.Err()
			}
			return req, nil
		case <-tick.C:
		}
	}
	return req, nil
}
