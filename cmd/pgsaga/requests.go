package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/saga"
)

// requestJSON is the outcome of `retry` and `cancel` with --json. Its field
// names are a contract.
type requestJSON struct {
	RequestID string     `json:"request_id"`
	SagaID    string     `json:"saga_id"`
	Kind      string     `json:"kind"`
	Outcome   string     `json:"outcome"` // done, refused, or pending (not carried out yet)
	Detail    string     `json:"detail"`
	DoneAt    *time.Time `json:"done_at"`
	Status    string     `json:"saga_status,omitempty"`
	// Queued is false for a request not carried out whose message is no
	// longer queued: it was dead-lettered (asking again publishes it again).
	Queued bool `json:"queued"`
}

func toRequestJSON(r saga.Request) requestJSON {
	out := requestJSON{RequestID: r.ID.String(), SagaID: r.SagaID.String(), Kind: string(r.Kind), Outcome: r.Outcome, Detail: r.Detail,
		DoneAt: r.DoneAt, Queued: r.Queued}
	if r.DoneAt == nil {
		out.Outcome = "pending"
	}
	return out
}

func retryCmd() *cobra.Command {
	return requestCmd(saga.RequestRetry, "retry [<saga-id>]",
		"Get a parked or stuck saga moving again: a failed compensation is sent again under a fresh key; a running saga's command in flight is sent again")
}

func cancelCmd() *cobra.Command {
	return requestCmd(saga.RequestCancel, "cancel [<saga-id>]",
		"Compensate a running saga on purpose: the step in flight and those before it are undone, last first")
}

// requestCmd asks the workers to carry out kind for a saga, or for each
// saga the flags select (the tool runs no saga), and waits for the
// outcome.
func requestCmd(kind saga.RequestKind, use, short string) *cobra.Command {
	var (
		reason    string
		noWait    bool
		timeout   time.Duration
		asJSON    bool
		status    []string
		name      string
		olderThan time.Duration
		yes       bool
	)
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Long: short + ".\n\nThe request is recorded and published to the workers in one transaction; a worker that knows the saga carries it " +
			"out at once, once, and records the outcome, which this command waits for unless --no-wait. Asking again for the saga as it is now " +
			"is the same request (published again if its message was dead-lettered).\n\n" +
			"Instead of a saga id, --status, --saga and --older-than select sagas as `pgsaga sagas` does: the request is asked of each " +
			"(with --yes; without, it says how many it would ask), and the report says how each ended. Exit 0 only if every one was " +
			"carried out and done; a refusal, or one not carried out within --timeout, is exit 1.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if timeout <= 0 {
				return usagef("--timeout must be positive, got %s", timeout)
			}
			if err := checkText("--reason", reason); err != nil {
				return err
			}
			bulk := cmd.Flags().Changed("status") || cmd.Flags().Changed("saga") || cmd.Flags().Changed("older-than")
			switch {
			case len(args) == 1 && bulk:
				return usagef("give a saga id, or --status, --saga and --older-than to select sagas, not both")
			case len(args) == 0 && !bulk:
				return usagef("give a saga id, or select sagas with --status, --saga and --older-than")
			case bulk:
				f, err := present.SagaFilter(status, name, olderThan, askBatch)
				if err != nil {
					return usagef("--%v", err)
				}
				b := bulkRequest{kind: kind, reason: reason, filter: f, noWait: noWait, timeout: timeout, asJSON: asJSON}
				return withClient(cmd.Context(), func(c *saga.Client) error {
					if !yes {
						n, err := c.CountSelected(cmd.Context(), f)
						if err != nil {
							return err
						}
						return usagef("%s would be asked of %d saga%s (%s); repeat with --yes to ask", kind, n, present.Plural(n), describeFilter(f))
					}
					return askEach(cmd, c, b)
				})
			}
			id, err := uuid.Parse(args[0])
			if err != nil {
				return usagef("%q is not a saga id (a UUID)", args[0])
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				req, err := c.Ask(cmd.Context(), id, kind, reason)
				if err != nil {
					return err
				}
				if !noWait && req.DoneAt == nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "%s of %s requested (request %s); waiting for a worker…\n", kind, id, req.ID)
					req, err = awaitRequest(cmd.Context(), c, req, timeout)
					if err != nil {
						return err
					}
				}
				return report(cmd, c, req, noWait, timeout, asJSON)
			})
		},
	}
	if kind == saga.RequestCancel {
		cmd.Flags().StringVar(&reason, "reason", "", "why, for the saga's timeline")
	}
	cmd.Flags().BoolVar(&noWait, "no-wait", false, "record the request and return; the workers carry it out")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for a worker")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the outcome as a JSON object")
	cmd.Flags().StringSliceVar(&status, "status", nil, "instead of a saga id: every saga in these statuses ("+present.StatusList()+"); repeat or separate with commas")
	cmd.Flags().StringVar(&name, "saga", "", "instead of a saga id: every saga of this name")
	cmd.Flags().DurationVar(&olderThan, "older-than", 0, "instead of a saga id: every saga not updated for at least this long (e.g. 10m)")
	cmd.Flags().BoolVar(&yes, "yes", false, "confirm: ask every saga the flags select")
	return cmd
}

// awaitRequest waits until a worker carried req out, or timeout; then
// it returns the request as last read (pending, with no DoneAt, after
// timeout).
func awaitRequest(ctx context.Context, c *saga.Client, req saga.Request, timeout time.Duration) (saga.Request, error) {
	got, err := awaitRequests(ctx, c, []saga.Request{req}, timeout, nil)
	if err != nil {
		return saga.Request{}, err
	}
	return got[0], nil
}

func report(cmd *cobra.Command, c *saga.Client, req saga.Request, noWait bool, timeout time.Duration, asJSON bool) error {
	out := toRequestJSON(req)
	name := ""
	if in, err := c.Get(cmd.Context(), req.SagaID); err == nil {
		out.Status, name = string(in.Status), in.Type
	}
	if asJSON {
		if err := writeJSON(cmd.OutOrStdout(), out); err != nil {
			return err
		}
	}
	switch {
	case req.DoneAt == nil && noWait:
		if !asJSON {
			fmt.Fprintf(cmd.OutOrStdout(), "%s of %s requested (request %s); a worker carries it out\n", req.Kind, req.SagaID, req.ID)
		}
		return nil
	case req.Lost():
		return fmt.Errorf("the %s of %s was dead-lettered: a worker of saga %s failed to carry it out in its attempts (pgsaga dead-letters --topic %s says why); "+
			"once the cause is fixed, ask again: the request is published again", req.Kind, req.SagaID, name, saga.RequestTopic(name))
	case req.DoneAt == nil:
		return fmt.Errorf("no worker carried out the %s of %s within %s: is a worker of this saga running? (the request stays, and is carried out when one runs)", req.Kind, req.SagaID, timeout)
	case req.Outcome == saga.RequestRefused:
		return fmt.Errorf("%s of %s refused: %s", req.Kind, req.SagaID, req.Detail)
	}
	if !asJSON {
		fmt.Fprintf(cmd.OutOrStdout(), "%s of %s done; the saga is %s\n", req.Kind, req.SagaID, cell(present.Dash(out.Status)))
	}
	return nil
}

// askBatch is how many sagas a bulk request selects, and asks, at a time.
var askBatch = 100

// progressEvery is how often a bulk request says how far it got, on
// stderr, once it has taken that long.
var progressEvery = time.Second

// bulkRequest is a request asked of every saga a filter selects.
type bulkRequest struct {
	kind    saga.RequestKind
	reason  string
	filter  saga.Filter
	noWait  bool
	timeout time.Duration
	asJSON  bool
}

// bulkJSON is the outcome of a bulk `retry` or `cancel` with --json. Its
// field names are a contract.
type bulkJSON struct {
	Kind     string        `json:"kind"`
	Selected int           `json:"selected"`      // sagas the flags selected, counted before asking
	Asked    int           `json:"asked"`         // requests asked
	Done     int           `json:"done"`          // carried out: done
	Refused  int           `json:"refused"`       // carried out: refused, the saga was in no state for it
	Pending  int           `json:"pending"`       // not carried out (within --timeout, or --no-wait), still queued
	Lost     int           `json:"dead_lettered"` // not carried out: dead-lettered (ask again once a worker that knows the saga runs)
	NotFound int           `json:"not_found"`     // selected, but gone before they were asked
	Refusals []refusalJSON `json:"refusals"`      // the refusals, grouped by reason
	Requests []requestJSON `json:"requests"`
}

// refusalJSON is the refusals of one reason.
type refusalJSON struct {
	Reason  string   `json:"reason"` // the detail, the saga's id written <saga>
	Count   int      `json:"count"`
	SagaIDs []string `json:"saga_ids"`
}

// askEach asks b of every saga b.filter selects, waits for the outcomes
// unless b.noWait, and reports them. The selection is fixed first, once:
// its age made a cutoff on the database's clock, its ids read in full, so
// that what is asked is exactly what was selected, however long asking
// takes (a saga started or moved on meanwhile is not asked).
func askEach(cmd *cobra.Command, c *saga.Client, b bulkRequest) error {
	ctx := cmd.Context()
	selection, err := fixSelection(ctx, c, b.filter)
	if err != nil {
		return err
	}
	out := bulkJSON{Kind: string(b.kind), Selected: len(selection), Refusals: []refusalJSON{}, Requests: []requestJSON{}}
	if len(selection) == 0 {
		if b.asJSON {
			return writeJSON(cmd.OutOrStdout(), out)
		}
		fmt.Fprintln(cmd.OutOrStdout(), "no saga matches")
		return nil
	}
	progress := newProgress(cmd.ErrOrStderr())
	var asked []saga.Request
	for i, id := range selection {
		req, err := c.Ask(ctx, id, b.kind, b.reason)
		switch {
		case errors.Is(err, saga.ErrNoSuchSaga):
			out.NotFound++
		case err != nil:
			return interrupted(err, b.kind, len(asked))
		default:
			asked = append(asked, req)
		}
		if (i+1)%askBatch == 0 || i == len(selection)-1 {
			progress.say("%s: asked %d of %d sagas", b.kind, len(asked), len(selection))
		}
	}
	if !b.noWait {
		if asked, err = awaitRequests(ctx, c, asked, b.timeout, progress); err != nil {
			return interrupted(err, b.kind, len(asked))
		}
	}
	return reportBulk(cmd, b, out, asked)
}

// fixSelection reads the ids of every saga f selects now, its age fixed
// as a cutoff on the database's clock first (saga.Client.FixFilter).
func fixSelection(ctx context.Context, c *saga.Client, f saga.Filter) ([]uuid.UUID, error) {
	f, err := c.FixFilter(ctx, f)
	if err != nil {
		return nil, err
	}
	var ids []uuid.UUID
	for after := uuid.Nil; ; {
		page, err := c.SelectedIDs(ctx, f, after)
		if err != nil {
			return nil, err
		}
		if len(page) == 0 {
			return ids, nil
		}
		ids = append(ids, page...)
		after = page[len(page)-1]
	}
}

// interrupted is err, which stopped a bulk request after it asked n.
func interrupted(err error, kind saga.RequestKind, n int) error {
	return fmt.Errorf("%w (after asking for the %s of %d sagas: those requests stand, and are carried out)", err, kind, n)
}

// awaitRequests waits until each of reqs was carried out by a worker or
// dead-lettered (saga.Request.Lost), or timeout; it returns them as last
// read, saying how far it got on progress (if not nil). A tool's wait for
// rows: a short poll, not a worker's.
func awaitRequests(ctx context.Context, c *saga.Client, reqs []saga.Request, timeout time.Duration, progress *progress) ([]saga.Request, error) {
	wait, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		var pending []uuid.UUID
		index := map[uuid.UUID]int{}
		for i, r := range reqs {
			if r.DoneAt == nil && !r.Lost() {
				pending = append(pending, r.ID)
				index[r.ID] = i
			}
		}
		if len(pending) == 0 {
			return reqs, nil
		}
		for chunk := range slices.Chunk(pending, 1000) {
			got, err := c.RequestStatuses(wait, chunk)
			if err != nil {
				if ctx.Err() == nil && wait.Err() != nil {
					return reqs, nil // the time is up: reported as pending
				}
				return reqs, err
			}
			for id, r := range got {
				reqs[index[id]] = r
			}
		}
		done := 0
		for _, r := range reqs {
			if r.DoneAt != nil {
				done++
			}
		}
		progress.say("%s: %d of %d carried out, %d waiting for a worker", reqs[0].Kind, done, len(reqs), len(pending))
		select {
		case <-wait.Done():
			if ctx.Err() != nil {
				return reqs, ctx.Err()
			}
			return reqs, nil
		case <-tick.C:
		}
	}
}

// reportBulk reports how the requests of a bulk request ended: a failure
// (exit 1) unless every one was carried out and done, or, with --no-wait,
// is still to be.
func reportBulk(cmd *cobra.Command, b bulkRequest, out bulkJSON, reqs []saga.Request) error {
	out.Asked = len(reqs)
	groups := map[string]int{}
	var pending, lost []string
	for _, r := range reqs {
		j := toRequestJSON(r)
		switch {
		case r.Lost():
			out.Lost++
			lost = append(lost, j.SagaID)
		case r.DoneAt == nil:
			out.Pending++
			pending = append(pending, j.SagaID)
		case r.Outcome == saga.RequestRefused:
			out.Refused++
			reason := strings.ReplaceAll(r.Detail, j.SagaID, "<saga>")
			i, ok := groups[reason]
			if !ok {
				i = len(out.Refusals)
				groups[reason] = i
				out.Refusals = append(out.Refusals, refusalJSON{Reason: reason})
			}
			out.Refusals[i].Count++
			out.Refusals[i].SagaIDs = append(out.Refusals[i].SagaIDs, j.SagaID)
		default:
			out.Done++
		}
		out.Requests = append(out.Requests, j)
	}
	w := cmd.OutOrStdout()
	if b.asJSON {
		if err := writeJSON(w, out); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(w, "%s asked of %d saga%s: %d done, %d refused, ", b.kind, out.Asked, present.Plural(out.Asked), out.Done, out.Refused)
		if b.noWait {
			fmt.Fprintf(w, "%d to be carried out by the workers", out.Pending)
		} else {
			fmt.Fprintf(w, "%d not carried out within %s", out.Pending, b.timeout)
		}
		if out.Lost > 0 {
			fmt.Fprintf(w, ", %d dead-lettered", out.Lost)
		}
		if out.NotFound > 0 {
			fmt.Fprintf(w, "; %d selected were gone before they were asked", out.NotFound)
		}
		fmt.Fprintln(w)
		for _, g := range out.Refusals {
			fmt.Fprintf(w, "  refused %d: %s\n    %s\n", g.Count, cell(g.Reason), someIDs(g.SagaIDs))
		}
		if out.Lost > 0 {
			fmt.Fprintf(w, "  dead-lettered %d: no worker that knows %s carried them out in their attempts; once one runs, ask again\n    %s\n",
				out.Lost, cell(sagaNamed(b.filter.Type)), someIDs(lost))
		}
		if out.Pending > 0 && !b.noWait {
			fmt.Fprintf(w, "  not carried out within %s %d: is a worker of %s running? (the requests stay, and are carried out when one runs)\n    %s\n",
				b.timeout, out.Pending, cell(sagaNamed(b.filter.Type)), someIDs(pending))
		}
	}
	switch {
	case out.Refused > 0 || out.Lost > 0 || out.NotFound > 0 || out.Pending > 0 && !b.noWait:
		return fmt.Errorf("%s: %d of the %d sagas selected did not get it done (%d refused, %d not carried out, %d dead-lettered, %d gone)",
			b.kind, out.Refused+out.Pending+out.Lost+out.NotFound, out.Selected, out.Refused, out.Pending, out.Lost, out.NotFound)
	}
	return nil
}

// someIDs lists the first few of ids, saying how many more there are.
func someIDs(ids []string) string {
	const few = 5
	if len(ids) <= few {
		return strings.Join(ids, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ids[:few], ", "), len(ids)-few)
}

func sagaNamed(name string) string {
	if name == "" {
		return "these sagas"
	}
	return "saga " + name
}

// describeFilter says what f selects, for people.
func describeFilter(f saga.Filter) string {
	var parts []string
	if len(f.Statuses) > 0 {
		s := make([]string, len(f.Statuses))
		for i, st := range f.Statuses {
			s[i] = string(st)
		}
		parts = append(parts, "status "+strings.Join(s, ", "))
	}
	if f.Type != "" {
		parts = append(parts, "saga "+cell(f.Type))
	}
	if f.OlderThan > 0 {
		parts = append(parts, "not updated for "+f.OlderThan.String())
	}
	if len(parts) == 0 {
		return "every saga"
	}
	return strings.Join(parts, "; ")
}

// progress says how far a long run got, every progressEvery.
type progress struct {
	w    io.Writer
	next time.Time
}

func newProgress(w io.Writer) *progress { return &progress{w: w, next: time.Now().Add(progressEvery)} }

// say writes a line if the last was progressEvery ago (the first, once
// the run has taken that long).
func (p *progress) say(format string, args ...any) {
	now := time.Now()
	if p == nil || now.Before(p.next) {
		return
	}
	p.next = now.Add(progressEvery)
	fmt.Fprintln(p.w, cell(fmt.Sprintf(format, args...)))
}
