package main

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/steps/transport"
)

// groupJSON is a consumer group in `consumers --json`. Its field names are
// a contract.
type groupJSON struct {
	Topic           string     `json:"topic"`
	ConsumerGroup   string     `json:"consumer_group"`
	Waiting         int        `json:"waiting"`
	Retrying        int        `json:"retrying"`
	NotYetAvailable int        `json:"not_yet_available"`
	OldestAgeS      *float64   `json:"oldest_age_s"`
	LastSeenAt      *time.Time `json:"last_seen_at"`
	Running         bool       `json:"running"`
}

func consumersCmd() *cobra.Command {
	var (
		stale  time.Duration
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "consumers",
		Short: "Every consumer group of every topic: messages waiting, age of the oldest, whether a worker runs it",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if stale <= 0 {
				return usagef("--stale must be positive, got %s", stale)
			}
			return withTransport(cmd.Context(), func(tr *transport.Transport) error {
				groups, err := tr.ConsumerGroups(cmd.Context())
				if err != nil {
					return err
				}
				now := time.Now()
				if asJSON {
					out := make([]groupJSON, len(groups))
					for i, g := range groups {
						out[i] = groupJSON{Topic: g.Topic, ConsumerGroup: g.ConsumerGroup, Waiting: g.Waiting, Retrying: g.Retrying,
							NotYetAvailable: g.NotYetAvailable, LastSeenAt: g.LastSeen, Running: g.Running(now, stale)}
						if g.Oldest != nil {
							a := round(now.Sub(*g.Oldest).Seconds())
							out[i].OldestAgeS = &a
						}
					}
					return writeJSON(cmd.OutOrStdout(), out)
				}
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "TOPIC\tGROUP\tWAITING\tRETRYING\tLATER\tOLDEST\tLAST SEEN\tRUNNING")
				for _, g := range groups {
					oldest, seen := "-", "never"
					if g.Oldest != nil {
						oldest = age(now.Sub(*g.Oldest))
					}
					if g.LastSeen != nil {
						seen = age(now.Sub(*g.LastSeen)) + " ago"
					}
					fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\t%s\t%s\n", g.Topic, g.ConsumerGroup, g.Waiting, g.Retrying, g.NotYetAvailable,
						oldest, seen, yesNo(g.Running(now, stale)))
				}
				return tw.Flush()
			})
		},
	}
	cmd.Flags().DurationVar(&stale, "stale", 2*time.Minute, "a group no worker showed alive for this long is not running (workers show theirs every 30s by default)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	cmd.AddCommand(dropGroupCmd())
	return cmd
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

func dropGroupCmd() *cobra.Command {
	var (
		topic string
		yes   bool
	)
	cmd := &cobra.Command{
		Use:   "drop <group>",
		Short: "Forget a consumer group that no longer runs, and delete the messages waiting for it",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			group := args[0]
			if err := transport.ValidateConsumerGroup(group); err != nil {
				return usageError{err}
			}
			return withTransport(cmd.Context(), func(tr *transport.Transport) error {
				groups, err := tr.ConsumerGroups(cmd.Context())
				if err != nil {
					return err
				}
				var targets []transport.GroupStats
				for _, g := range groups {
					if g.ConsumerGroup == group && (topic == "" || g.Topic == topic) {
						targets = append(targets, g)
					}
				}
				if len(targets) == 0 {
					return fmt.Errorf("no consumer group %q%s", group, onTopic(topic))
				}
				if !yes {
					waiting := 0
					for _, g := range targets {
						waiting += g.Waiting
					}
					return usagef("dropping %q%s deletes the %d messages waiting for it; repeat with --yes to do it", group, onTopic(topic), waiting)
				}
				for _, g := range targets {
					n, err := tr.DropConsumerGroup(cmd.Context(), g.Topic, g.ConsumerGroup)
					if err != nil {
						return err
					}
					fmt.Fprintf(cmd.OutOrStdout(), "dropped %s of %s (%d messages deleted)\n", g.ConsumerGroup, g.Topic, n)
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&topic, "topic", "", "only of this topic (default: every topic the group reads)")
	cmd.Flags().BoolVar(&yes, "yes", false, "confirm: the messages waiting for the group are deleted")
	return cmd
}

func onTopic(topic string) string {
	if topic == "" {
		return ""
	}
	return " of topic " + topic
}
