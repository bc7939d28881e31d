package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/pgserver"
	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/internal/termsafe"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/migrations"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// sagaJSON is a saga in --json listings. Its field names are a contract.
type sagaJSON struct {
	ID            string          `json:"id"`
	Saga          string          `json:"saga"`
	Version       int             `json:"definition_version"`
	Status        string          `json:"status"`
	Step          string          `json:"step"`
	Phase         string          `json:"phase"`
	Attempt       int             `json:"attempt"`
	AgeS          float64         `json:"age_s"`
	CorrelationID string          `json:"correlation_id"`
	FailureReason string          `json:"failure_reason"`
	CreatedAt     time.Time       `json:"created_at"`
	UpdatedAt     time.Time       `json:"updated_at"`
	FinishedAt    *time.Time      `json:"finished_at"`
	Data          json.RawMessage `json:"data,omitempty"`
	DataBytes     int             `json:"data_bytes"`             // size of its data as JSON
	DataPreview   string          `json:"data_preview,omitempty"` // its first characters, in listings (which do not read the data)
	Timeline      []timelineJSON  `json:"timeline,omitempty"`
}

// timelineJSON is one entry of a saga's timeline in `show --json`.
type timelineJSON struct {
	Seq       int       `json:"seq"`
	At        time.Time `json:"at"`
	SinceMs   float64   `json:"since_start_ms"`
	Kind      string    `json:"kind"`
	Step      string    `json:"step"`
	Phase     string    `json:"phase"`
	Attempt   int       `json:"attempt"`
	MessageID string    `json:"message_id"`
	Detail    string    `json:"detail"`
}

func toJSON(in saga.Instance, now time.Time) sagaJSON {
	out := sagaJSON{ID: in.ID.String(), Saga: in.Type, Version: in.DefinitionVersion, Status: string(in.Status), Step: in.Step,
		Phase: string(in.Phase), Attempt: in.Attempt, AgeS: round(now.Sub(in.CreatedAt).Seconds()), CorrelationID: in.CorrelationID,
		FailureReason: in.FailureReason, CreatedAt: in.CreatedAt, UpdatedAt: in.UpdatedAt, FinishedAt: in.FinishedAt,
		DataBytes: in.DataBytes, DataPreview: in.DataPreview}
	for _, h := range in.History {
		out.Timeline = append(out.Timeline, timelineJSON{Seq: h.Seq, At: h.At, SinceMs: round(float64(h.At.Sub(in.CreatedAt).Microseconds()) / 1000),
			Kind: h.Kind, Step: h.Step, Phase: string(h.Phase), Attempt: h.Attempt, MessageID: h.MessageID, Detail: h.Detail})
	}
	return out
}

func round(f float64) float64 { return float64(int64(f*1000+0.5)) / 1000 }

// writeJSON writes v as indented JSON: the values exactly, the characters
// a terminal would act on escaped (termsafe.JSON).
func writeJSON(w io.Writer, v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := w.Write(termsafe.JSON(b.Bytes()))
	return err
}

func sagasCmd() *cobra.Command {
	var (
		status    []string
		name      string
		olderThan time.Duration
		limit     int
		asJSON    bool
	)
	cmd := &cobra.Command{
		Use:   "sagas",
		Short: "List saga instances: status, current step, age, attempts (least recently updated first)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := present.SagaFilter(status, name, olderThan, limit)
			if err != nil {
				return usagef("--%v", err)
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				list, err := c.List(cmd.Context(), f)
				if err != nil {
					return err
				}
				if asJSON {
					out := make([]sagaJSON, len(list))
					for i, in := range list {
						out[i] = toJSON(in, present.DBNow(in))
					}
					return writeJSON(cmd.OutOrStdout(), out)
				}
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tSAGA\tSTATUS\tSTEP\tPHASE\tATTEMPT\tAGE\tUPDATED")
				for _, in := range list {
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s ago\n", in.ID, cell(in.Type), cell(string(in.Status)), cell(present.Dash(in.Step)),
						cell(present.Dash(string(in.Phase))), in.Attempt, present.Age(present.DBNow(in).Sub(in.CreatedAt)), present.Age(present.DBNow(in).Sub(in.UpdatedAt)))
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				if len(list) == 0 {
					fmt.Fprintln(cmd.ErrOrStderr(), "no saga matches")
				}
				return nil
			})
		},
	}
	cmd.Flags().StringSliceVar(&status, "status", nil, "only these statuses ("+present.StatusList()+"); repeat or separate with commas")
	cmd.Flags().StringVar(&name, "saga", "", "only sagas of this name")
	cmd.Flags().DurationVar(&olderThan, "older-than", 0, "only sagas not updated for at least this long (e.g. 10m)")
	cmd.Flags().IntVar(&limit, "limit", 100, "at most this many")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

func checkLimit(limit int) error {
	if err := present.LimitError(limit); err != nil {
		return usagef("--%v", err)
	}
	return nil
}

// cell is s as a cell of a table: one line, safe on a terminal
// (termsafe.Line).
func cell(s string) string { return termsafe.Line(s) }

func showCmd() *cobra.Command {
	var (
		asJSON    bool
		name, key string
	)
	cmd := &cobra.Command{
		Use:   "show <saga-id> | show --saga NAME --key KEY",
		Short: "Show a saga instance and its timeline: what was sent, when, what came back",
		Long: "show prints a saga instance and its timeline, by its id, or by the saga's name and the business key its trigger " +
			"gave (--saga and --key: an order's id, say), which name one instance.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, err := showTarget(args, name, key, cmd.Flags().Changed("saga"), cmd.Flags().Changed("key"))
			if err != nil {
				return err
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				in, err := c.Get(cmd.Context(), id)
				if errors.Is(err, saga.ErrNoSuchSaga) && len(args) == 0 {
					return fmt.Errorf("no saga %s has the key %s (it would be %s): %w", cell(name), cell(key), id, err)
				}
				if err != nil {
					return err
				}
				if asJSON {
					return writeJSON(cmd.OutOrStdout(), toJSON(in, present.DBNow(in)))
				}
				return printSaga(cmd.OutOrStdout(), in)
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON object, timeline included")
	cmd.Flags().StringVar(&name, "saga", "", "instead of an id: the saga's name (with --key)")
	cmd.Flags().StringVar(&key, "key", "", "instead of an id: the business key the saga's trigger gave (with --saga)")
	return cmd
}

// showTarget is the instance show names: the id argument, or the
// instance of saga name started by key.
func showTarget(args []string, name, key string, nameSet, keySet bool) (uuid.UUID, error) {
	switch {
	case len(args) == 1 && (nameSet || keySet):
		return uuid.Nil, usagef("give a saga id, or --saga and --key, not both")
	case len(args) == 1:
		id, err := uuid.Parse(args[0])
		if err != nil {
			return uuid.Nil, usagef("%q is not a saga id (a UUID)", args[0])
		}
		return id, nil
	case !nameSet || !keySet:
		return uuid.Nil, usagef("give a saga id, or both --saga NAME and --key KEY")
	case name == "" || key == "":
		return uuid.Nil, usagef("--saga and --key must not be empty")
	}
	for flag, v := range map[string]string{"--saga": name, "--key": key} {
		if why := transport.Unstorable(v); why != "" {
			return uuid.Nil, usagef("%s holds %s", flag, why)
		}
	}
	return saga.ID(name, key), nil
}

func printSaga(w io.Writer, in saga.Instance) error {
	fmt.Fprintf(w, "saga      %s (%s v%d)\n", in.ID, cell(in.Type), in.DefinitionVersion)
	fmt.Fprintf(w, "status    %s", cell(string(in.Status)))
	if in.Step != "" {
		fmt.Fprintf(w, " at %s (%s, attempt %d)", cell(in.Step), cell(string(in.Phase)), in.Attempt)
	}
	fmt.Fprintln(w)
	if in.FailureReason != "" {
		fmt.Fprintf(w, "reason    %s\n", cell(in.FailureReason))
	}
	fmt.Fprintf(w, "started   %s\n", in.CreatedAt.Format(time.RFC3339Nano))
	if in.FinishedAt != nil {
		fmt.Fprintf(w, "finished  %s (after %s)\n", in.FinishedAt.Format(time.RFC3339Nano), in.FinishedAt.Sub(in.CreatedAt).Round(time.Microsecond))
	}
	if in.CorrelationID != "" {
		fmt.Fprintf(w, "order     %s\n", cell(in.CorrelationID))
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\t+MS\tKIND\tSTEP\tPHASE\tATTEMPT\tDETAIL")
	for _, h := range in.History {
		fmt.Fprintf(tw, "%d\t%.1f\t%s\t%s\t%s\t%s\t%s\n", h.Seq, float64(h.At.Sub(in.CreatedAt).Microseconds())/1000, cell(h.Kind), cell(present.Dash(h.Step)),
			cell(present.Dash(string(h.Phase))), present.Attempt(h.Attempt), cell(present.OneLine(h.Detail)))
	}
	return tw.Flush()
}

func deadLettersCmd() *cobra.Command {
	var (
		topic  string
		limit  int
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "dead-letters",
		Short: "List the messages that could not be handled, with why",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkLimit(limit); err != nil {
				return err
			}
			if err := checkText("--topic", topic); err != nil {
				return err
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				dl, err := c.DeadLetters(cmd.Context(), delivery.DeadLetterFilter{Topic: topic, Limit: limit})
				if err != nil {
					return err
				}
				if asJSON {
					out := make([]deadLetterJSON, len(dl))
					for i, d := range dl {
						out[i] = toDeadLetterJSON(d)
					}
					return writeJSON(cmd.OutOrStdout(), out)
				}
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tTOPIC\tGROUP\tATTEMPTS\tSIZE\tDEAD\tREPLAYED\tREASON")
				for _, d := range dl {
					now := present.DeadLetterNow(d)
					fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\t%s ago\t%s\t%s\n", d.ID, cell(d.Topic), cell(present.Dash(d.ConsumerGroup)), d.Attempts, byteSize(d.PayloadSize),
						present.Age(now.Sub(d.DeadAt)), replayedCell(d, now), cell(present.Clip(present.OneLine(d.Reason), 100)))
				}
				return tw.Flush()
			})
		},
	}
	cmd.Flags().StringVar(&topic, "topic", "", "only dead letters of this topic")
	cmd.Flags().IntVar(&limit, "limit", 100, "at most this many, oldest first")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	cmd.AddCommand(replayCmd(), showDeadLetterCmd(), deleteDeadLettersCmd())
	return cmd
}

func replayCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "replay <id>...",
		Short: "Send dead letters back to their topic's queue, once each; the dead letter keeps a record that it was replayed",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := deadLetterIDs(args)
			if err != nil {
				return err
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				var errs []error
				for _, id := range ids {
					done, err := present.ReplayDeadLetter(cmd.Context(), c, id)
					if err != nil {
						errs = append(errs, err)
						fmt.Fprintf(cmd.ErrOrStderr(), "dead letter %d: %s\n", id, cell(err.Error()))
						continue
					}
					fmt.Fprintln(cmd.OutOrStdout(), done)
				}
				if len(errs) > 0 {
					return fmt.Errorf("%d of %d dead letters not replayed", len(errs), len(ids))
				}
				return nil
			})
		},
	}
}

func migrateCmd() *cobra.Command {
	var dryRun, showSQL bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the migrations this binary knows to the database, or say what it would apply",
		Long: "migrate applies pgsaga's pending migrations (its tables only; an application's own come from its migrations). " +
			"--dry-run lists them and changes nothing, not even the version table; --show-sql prints their SQL, " +
			"with the rows that record them, for teams that apply migrations with their own tool: " +
			"`pgsaga migrate --dry-run --show-sql | psql -v ON_ERROR_STOP=1` leaves the database as migrate would " +
			"(without ON_ERROR_STOP psql goes on after a failed migration).",
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, out := cmd.Context(), cmd.OutOrStdout()
			return withDB(ctx, func(db *pgdb.DB) error {
				if dryRun || showSQL {
					if err := pgserver.RequireUTF8(ctx, db.SQL); err != nil {
						return err
					}
					pending, err := migrations.Pending(ctx, db.SQL)
					if err != nil {
						return err
					}
					switch {
					case len(pending) == 0 && showSQL:
						fmt.Fprintln(out, "-- the schema is up to date: nothing to apply")
						return nil
					case len(pending) == 0:
						fmt.Fprintln(out, "the schema is up to date")
						return nil
					case showSQL:
						fmt.Fprint(out, migrations.Script(pending))
					default:
						fmt.Fprintf(out, "would apply %d migrations:\n", len(pending))
						for _, m := range pending {
							fmt.Fprintf(out, "  %s\n", m.File)
						}
					}
					if dryRun {
						return nil
					}
				}
				applied, err := migrations.Apply(ctx, db.SQL)
				if err != nil {
					return err
				}
				if len(applied) == 0 {
					fmt.Fprintln(out, "the schema is up to date")
					return nil
				}
				fmt.Fprintf(out, "applied %v\n", applied)
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "say what would be applied, and apply nothing")
	cmd.Flags().BoolVar(&showSQL, "show-sql", false, "print the SQL of the pending migrations (only that, with --dry-run, so that it can be piped to psql)")
	return cmd
}

// versionJSON is `version --json`. Its field names are a contract.
type versionJSON struct {
	Binary        string `json:"binary"`
	SchemaVersion int64  `json:"schema_version"`
	SchemaKnown   int64  `json:"schema_known"`
	UpToDate      bool   `json:"up_to_date"`
}

func versionCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "The binary's version, and the database's schema version against the one it knows",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withDB(cmd.Context(), func(db *pgdb.DB) error {
				current, known, err := migrations.Version(cmd.Context(), db.SQL)
				if err != nil {
					return err
				}
				v := versionJSON{Binary: binaryVersion(), SchemaVersion: current, SchemaKnown: known, UpToDate: current == known}
				if asJSON {
					return writeJSON(cmd.OutOrStdout(), v)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "pgsaga %s\nschema %d (this binary knows %d)", v.Binary, current, known)
				switch {
				case current < known:
					fmt.Fprint(cmd.OutOrStdout(), ": run pgsaga migrate")
				case current > known:
					fmt.Fprint(cmd.OutOrStdout(), ": the database was migrated by a newer release")
				}
				fmt.Fprintln(cmd.OutOrStdout())
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON object")
	return cmd
}

func binaryVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}
