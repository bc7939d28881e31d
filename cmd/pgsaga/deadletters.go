package main

import (
	"encoding/base64"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/internal/termsafe"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// deadLetterJSON is a dead letter in `dead-letters --json` (a bounded part
// of each) and `dead-letters show --json` (whole). Its field names are a
// contract.
type deadLetterJSON struct {
	ID            int64     `json:"id"`
	UUID          string    `json:"uuid"`
	Topic         string    `json:"topic"`
	ConsumerGroup string    `json:"consumer_group"`
	Handler       string    `json:"handler"`
	Reason        string    `json:"reason"` // in a listing, its first delivery.DeadLetterListText characters
	ReasonLength  int       `json:"reason_length"`
	Attempts      int       `json:"attempts"`
	CreatedAt     time.Time `json:"created_at"`
	DeadAt        time.Time `json:"dead_at"`
	// DeadAgeS is how long ago it was dead-lettered, in seconds, on the
	// database's clock.
	DeadAgeS   float64    `json:"dead_age_s"`
	ReplayedAt *time.Time `json:"replayed_at"`
	// Replayable is false for what a broker bridge received but could not
	// queue: replay refuses it, the sender must send it again.
	Replayable bool `json:"replayable"`
	// Metadata is null when it is not a JSON object of strings, and in a
	// listing when its text is longer than delivery.DeadLetterListText
	// bytes; MetadataSize is that length.
	Metadata     map[string]string `json:"metadata"`
	MetadataSize int               `json:"metadata_size"`
	// Payload is the whole payload as text: null when the output holds
	// only part of it (PayloadComplete false) or it is not UTF-8.
	Payload         *string `json:"payload"`
	PayloadSize     int     `json:"payload_size"`
	PayloadComplete bool    `json:"payload_complete"`
	// PayloadPreview is its first delivery.DeadLetterPreviewBytes bytes as
	// text (a character they cut in two left out), null if they are not
	// UTF-8; PayloadPreviewBase64 the same bytes as they are.
	PayloadPreview       *string `json:"payload_preview"`
	PayloadPreviewBase64 string  `json:"payload_preview_base64"`
	// PayloadBase64 is the whole payload's bytes, in `show --json` only.
	PayloadBase64 *string `json:"payload_base64,omitempty"`
}

func toDeadLetterJSON(d delivery.DeadLetter) deadLetterJSON {
	out := deadLetterJSON{ID: d.ID, UUID: d.UUID, Topic: d.Topic, ConsumerGroup: d.ConsumerGroup, Handler: d.Handler,
		Reason: d.Reason, ReasonLength: d.ReasonLength, Attempts: d.Attempts, CreatedAt: d.CreatedAt, DeadAt: d.DeadAt, DeadAgeS: round(present.DeadLetterNow(d).Sub(d.DeadAt).Seconds()),
		ReplayedAt: d.ReplayedAt, Replayable: d.Replayable(), Metadata: d.Metadata, MetadataSize: d.MetadataSize,
		PayloadSize: d.PayloadSize, PayloadComplete: d.PayloadComplete(),
		PayloadPreview: utf8Text(d.PayloadPreview, len(d.PayloadPreview) < d.PayloadSize), PayloadPreviewBase64: base64.StdEncoding.EncodeToString(d.PayloadPreview)}
	switch {
	case d.Payload != nil:
		out.Payload = utf8Text(d.Payload, false)
		b := base64.StdEncoding.EncodeToString(d.Payload)
		out.PayloadBase64 = &b
	case out.PayloadComplete:
		out.Payload = utf8Text(d.PayloadPreview, false)
	}
	return out
}

// utf8Text is b as text, or nil if it is not UTF-8; cut says b is the
// start of something longer, whose last character it may cut in two: that
// part is left out.
func utf8Text(b []byte, cut bool) *string {
	if cut {
		for i := len(b) - 1; i >= max(0, len(b)-utf8.UTFMax); i-- {
			if utf8.RuneStart(b[i]) {
				if !utf8.FullRune(b[i:]) {
					b = b[:i]
				}
				break
			}
		}
	}
	if !utf8.Valid(b) {
		return nil
	}
	s := string(b)
	return &s
}

// replayedCell says whether d was replayed, when, or that it cannot be.
func replayedCell(d delivery.DeadLetter, now time.Time) string {
	switch {
	case d.ReplayedAt != nil:
		return present.Age(now.Sub(*d.ReplayedAt)) + " ago"
	case !d.Replayable():
		return "cannot"
	}
	return "-"
}

// byteSize is n bytes for people: 312 B, 4.0 KiB, 20.0 MiB.
func byteSize(n int) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	f, prefix := float64(n)/unit, 0
	for f >= unit && prefix < 3 {
		f /= unit
		prefix++
	}
	return fmt.Sprintf("%.1f %ciB", f, "KMGT"[prefix])
}

// deadLetterIDs parses dead letter ids as dead-letters lists them.
func deadLetterIDs(args []string) ([]int64, error) {
	ids := make([]int64, len(args))
	for i, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id < 1 {
			return nil, usagef("%q is not a dead letter id (a positive number, as dead-letters lists)", a)
		}
		ids[i] = id
	}
	return ids, nil
}

func showDeadLetterCmd() *cobra.Command {
	var (
		asJSON     bool
		payloadOut string
	)
	cmd := &cobra.Command{
		Use:   "show <id>",
		Short: "Show one dead letter whole: its reason, metadata and payload; --payload-out writes the payload's bytes as they are",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := deadLetterIDs(args)
			if err != nil {
				return err
			}
			if payloadOut == "-" && asJSON {
				return usagef("--payload-out - writes the payload alone on stdout: not with --json")
			}
			if payloadOut == "-" && isTerminal(cmd.OutOrStdout()) {
				return usagef("--payload-out - would write the payload's bytes as they are to a terminal: redirect stdout, or name a file")
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				d, err := c.DeadLetter(cmd.Context(), ids[0])
				if err != nil {
					return err
				}
				switch payloadOut {
				case "":
				case "-":
					_, err := cmd.OutOrStdout().Write(d.Payload)
					return err
				default:
					if err := writeNewFile(payloadOut, d.Payload); err != nil {
						return err
					}
				}
				if asJSON {
					return writeJSON(cmd.OutOrStdout(), toDeadLetterJSON(d))
				}
				return printDeadLetter(cmd.OutOrStdout(), d, payloadOut)
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON object, the whole payload included (payload as text if it is UTF-8, payload_base64 as it is)")
	cmd.Flags().StringVar(&payloadOut, "payload-out", "", "write the payload's bytes, as they are, to this new file (never overwritten); - for stdout alone, redirected")
	return cmd
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	info, err := f.Stat()
	return err == nil && info.Mode()&os.ModeCharDevice != 0
}

// writeNewFile writes b to a file path that does not exist yet.
func writeNewFile(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("writing the payload: %w", err)
	}
	if _, err := f.Write(b); err != nil {
		_ = f.Close()
		return fmt.Errorf("writing the payload to %s: %w", path, err)
	}
	return f.Close()
}

// printDeadLetter shows d whole, for people; its payload went to
// payloadOut if that is not "".
func printDeadLetter(w io.Writer, d delivery.DeadLetter, payloadOut string) error {
	now := present.DeadLetterNow(d)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "dead letter\t%d\n", d.ID)
	fmt.Fprintf(tw, "message\t%s\n", cell(d.UUID))
	fmt.Fprintf(tw, "topic\t%s\n", cell(d.Topic))
	group := cell(d.ConsumerGroup)
	if d.ConsumerGroup == "" {
		group = "- (no consumer group read the topic)"
	}
	fmt.Fprintf(tw, "group\t%s\n", group)
	fmt.Fprintf(tw, "handler\t%s\n", cell(present.Dash(d.Handler)))
	fmt.Fprintf(tw, "attempts\t%d\n", d.Attempts)
	fmt.Fprintf(tw, "published\t%s\n", d.CreatedAt.Format(time.RFC3339Nano))
	fmt.Fprintf(tw, "dead\t%s (%s ago)\n", d.DeadAt.Format(time.RFC3339Nano), present.Age(now.Sub(d.DeadAt)))
	fmt.Fprintf(tw, "replayed\t%s\n", replayedCell(d, now))
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nreason\n%s\n", termsafe.Text(d.Reason))
	fmt.Fprintf(w, "\nmetadata (%s)\n", byteSize(d.MetadataSize))
	if d.Metadata != nil {
		keys := make([]string, 0, len(d.Metadata))
		for k := range d.Metadata {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			fmt.Fprintf(w, "  %s: %s\n", cell(k), cell(d.Metadata[k]))
		}
	} else {
		fmt.Fprintf(w, "  %s\n", cell(string(d.RawMetadata)))
	}
	fmt.Fprintf(w, "\npayload (%d bytes", len(d.Payload))
	if len(d.Payload) >= 1024 {
		fmt.Fprintf(w, ", %s", byteSize(len(d.Payload)))
	}
	fmt.Fprint(w, ")")
	switch {
	case payloadOut != "":
		fmt.Fprintf(w, ": %d bytes written to %s\n", len(d.Payload), cell(payloadOut))
		return nil
	case !utf8.Valid(d.Payload):
		fmt.Fprint(w, ", not UTF-8: what is not is shown as \\xNN (--payload-out FILE writes the bytes as they are)")
	}
	_, err := fmt.Fprintf(w, "\n%s\n", termsafe.Text(string(d.Payload)))
	return err
}

func deleteDeadLettersCmd() *cobra.Command {
	var (
		topic     string
		olderThan time.Duration
		yes       bool
	)
	cmd := &cobra.Command{
		Use:   "delete [<id>...]",
		Short: "Delete dead letters for good: those named, or those of --topic dead for longer than --older-than",
		Long: "Delete dead letters for good, replayed or not: those named by id, or every one of --topic dead-lettered longer " +
			"than --older-than ago (both are needed). Without --yes it says how many it would delete, and deletes none.",
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := deadLetterIDs(args)
			if err != nil {
				return err
			}
			ids = slices.Compact(slices.Sorted(slices.Values(ids)))
			sel := delivery.DeadLetterDeletion{IDs: ids, Topic: topic, OlderThan: olderThan}
			what := fmt.Sprintf("dead letters %s", joinIDs(ids))
			switch {
			case len(ids) > 0 && (topic != "" || olderThan != 0):
				return usagef("give dead letter ids, or --topic and --older-than, not both")
			case len(ids) == 0 && (topic == "" || olderThan <= 0):
				return usagef("give dead letter ids, or --topic T and a positive --older-than D together")
			case len(ids) == 0:
				if err := checkText("--topic", topic); err != nil {
					return err
				}
				what = fmt.Sprintf("the dead letters of %s dead for longer than %s", topic, olderThan)
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				if !yes {
					n, err := c.CountDeadLetters(cmd.Context(), sel)
					if err != nil {
						return err
					}
					return usagef("deleting %s deletes %d dead letter%s; repeat with --yes to do it", what, n, present.Plural(int(n)))
				}
				n, err := c.DeleteDeadLetters(cmd.Context(), sel)
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%d dead letter%s deleted\n", n, present.Plural(int(n)))
				if len(ids) > 0 && int(n) < len(ids) {
					return fmt.Errorf("%d of the %d dead letters named did not exist (deleted already?)", len(ids)-int(n), len(ids))
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&topic, "topic", "", "delete the dead letters of this topic (with --older-than)")
	cmd.Flags().DurationVar(&olderThan, "older-than", 0, "delete those dead-lettered longer than this ago (e.g. 720h; with --topic)")
	cmd.Flags().BoolVar(&yes, "yes", false, "confirm: the dead letters are deleted for good")
	return cmd
}

func joinIDs(ids []int64) string {
	b := make([]byte, 0, 8*len(ids))
	for i, id := range ids {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = strconv.AppendInt(b, id, 10)
	}
	return string(b)
}

// checkText refuses a flag's value that no name or text in the database
// can be (bytes that are not UTF-8, a NUL): a usage error that does not
// echo it.
func checkText(flag, value string) error {
	if bad := transport.Unstorable(value); bad != "" {
		return usagef("%s cannot hold %s", flag, bad)
	}
	return nil
}
