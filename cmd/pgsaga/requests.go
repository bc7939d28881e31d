package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps/transport"
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
}

func retryCmd() *cobra.Command {
	return requestCmd(saga.RequestRetry, "retry <saga-id>",
		"Get a parked or stuck saga moving again: a failed compensation is sent again under a fresh key; a running saga's command in flight is sent again")
}

func cancelCmd() *cobra.Command {
	return requestCmd(saga.RequestCancel, "cancel <saga-id>",
		"Compensate a running saga on purpose: the step in flight and those before it are undone, last first")
}

// requestCmd asks the workers to carry out kind for a saga (the tool runs
// no saga) and waits for the outcome.
func requestCmd(kind saga.RequestKind, use, short string) *cobra.Command {
	var (
		reason  string
		noWait  bool
		timeout time.Duration
		asJSON  bool
	)
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Long: short + ".\n\nThe request is recorded and published to the workers in one transaction; a worker that knows the saga carries it " +
			"out at once, once, and records the outcome, which this command waits for unless --no-wait. Asking again for the saga as it is now " +
			"is the same request.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, err := uuid.Parse(args[0])
			if err != nil {
				return usagef("%q is not a saga id (a UUID)", args[0])
			}
			if timeout <= 0 {
				return usagef("--timeout must be positive, got %s", timeout)
			}
			return withTransport(cmd.Context(), func(tr *transport.Transport) error {
				db := tr.Config().DB
				req, err := saga.Ask(cmd.Context(), tr, db, id, kind, reason)
				if err != nil {
					return err
				}
				if !noWait && req.DoneAt == nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "%s of %s requested (request %s); waiting for a worker…\n", kind, id, req.ID)
					req, err = awaitRequest(cmd.Context(), db, req, timeout)
					if err != nil {
						return err
					}
				}
				return report(cmd, db, req, noWait, timeout, asJSON)
			})
		},
	}
	if kind == saga.RequestCancel {
		cmd.Flags().StringVar(&reason, "reason", "", "why, for the saga's timeline")
	}
	cmd.Flags().BoolVar(&noWait, "no-wait", false, "record the request and return; the workers carry it out")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for a worker")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the outcome as a JSON object")
	return cmd
}

// awaitRequest waits until a worker carried req out, or timeout; then
// it returns the request as last read (pending, with no DoneAt, after
// timeout). A tool's wait for one row: a short poll, not a worker's.
func awaitRequest(ctx context.Context, db *sql.DB, req saga.Request, timeout time.Duration) (saga.Request, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		got, err := saga.RequestStatus(ctx, db, req.ID)
		if err == nil {
			req = got
			if req.DoneAt != nil {
				return req, nil
			}
		}
		if err != nil && ctx.Err() == nil {
			return saga.Request{}, err
		}
		select {
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return req, nil // reported as pending
			}
			return saga.Request{}, ctx.Err()
		case <-tick.C:
		}
	}
}

func report(cmd *cobra.Command, db *sql.DB, req saga.Request, noWait bool, timeout time.Duration, asJSON bool) error {
	out := requestJSON{RequestID: req.ID.String(), SagaID: req.SagaID.String(), Kind: string(req.Kind), Outcome: req.Outcome, Detail: req.Detail, DoneAt: req.DoneAt}
	if req.DoneAt == nil {
		out.Outcome = "pending"
	}
	if in, err := saga.NewInspector(db).Get(cmd.Context(), req.SagaID); err == nil {
		out.Status = string(in.Status)
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
	case req.DoneAt == nil:
		return fmt.Errorf("no worker carried out the %s of %s within %s: is a worker of this saga running? (the request stays, and is carried out when one runs)", req.Kind, req.SagaID, timeout)
	case req.Outcome == saga.RequestRefused:
		return fmt.Errorf("%s of %s refused: %s", req.Kind, req.SagaID, req.Detail)
	}
	if !asJSON {
		fmt.Fprintf(cmd.OutOrStdout(), "%s of %s done; the saga is %s\n", req.Kind, req.SagaID, dash(out.Status))
	}
	return nil
}
