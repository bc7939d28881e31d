package main

import (
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
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
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkStale(stale); err != nil {
				return err
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				groups, err := c.ConsumerGroups(cmd.Context())
				if err != nil {
					return err
				}
				// Ages are by the database's clock (GroupStats.ReadAt).
				if asJSON {
					out := make([]groupJSON, len(groups))
					for i, g := range groups {
						out[i] = groupJSON{Topic: g.Topic, ConsumerGroup: g.ConsumerGroup, Waiting: g.Waiting, Retrying: g.Retrying,
							NotYetAvailable: g.NotYetAvailable, LastSeenAt: g.LastSeen, Running: g.Running(stale)}
						if g.Oldest != nil {
							a := round(g.ReadAt.Sub(*g.Oldest).Seconds())
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
						oldest = present.Age(g.ReadAt.Sub(*g.Oldest))
					}
					if g.LastSeen != nil {
						seen = present.Age(g.ReadAt.Sub(*g.LastSeen)) + " ago"
					}
					fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\t%s\t%s\n", cell(g.Topic), cell(g.ConsumerGroup), g.Waiting, g.Retrying, g.NotYetAvailable,
						oldest, seen, yesNo(g.Running(stale)))
				}
				return tw.Flush()
			})
		},
	}
	cmd.PersistentFlags().DurationVar(&stale, "stale", 2*time.Minute, "a group no worker showed alive for this long is not running (workers show theirs every 30s by default)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	cmd.AddCommand(dropGroupCmd(&stale))
	return cmd
}

func checkStale(stale time.Duration) error {
	if stale <= 0 {
		return usagef("--stale must be positive, got %s", stale)
	}
	return nil
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

func dropGroupCmd(stale *time.Duration) *cobra.Command {
	var (
		topic string
		yes   bool
		force bool
	)
	cmd := &cobra.Command{
		Use:   "drop <group>",
		Short: "Forget a consumer group that no longer runs, and delete the messages waiting for it",
		Long: "Forget a consumer group that no longer runs, and delete the messages waiting for it. A group a worker showed alive " +
			"within --stale is refused (exit 1), unless --force: its workers would lose what waits for them. Without --yes it says " +
			"how many messages it would delete, and deletes none.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			group := args[0]
			if err := transport.ValidateConsumerGroup(group); err != nil {
				return usageError{err}
			}
			if topic != "" {
				if err := transport.ValidateTopic(topic); err != nil {
					return usageError{err}
				}
			}
			if err := checkStale(*stale); err != nil {
				return err
			}
			return withClient(cmd.Context(), func(c *saga.Client) error {
				groups, err := c.ConsumerGroups(cmd.Context())
				if err != nil {
					return err
				}
				waiting, alive := 0, &delivery.ConsumerGroupAliveError{ConsumerGroup: group}
				found := false
				for _, g := range groups {
					if g.ConsumerGroup != group || topic != "" && g.Topic != topic {
						continue
					}
					found = true
					waiting += g.Waiting
					if g.Running(*stale) {
						alive.Topics = append(alive.Topics, g.Topic)
						if g.LastSeen.After(alive.LastSeen) {
							alive.LastSeen, alive.Ago = *g.LastSeen, g.ReadAt.Sub(*g.LastSeen)
						}
					}
				}
				// With --yes, DropConsumerGroups checks again, locked against
				// a heartbeat in flight.
				switch {
				case !found:
					return fmt.Errorf("no consumer group %s%s", group, onTopic(topic))
				case !yes && len(alive.Topics) > 0 && !force:
					return refuseRunning(alive, *stale)
				case !yes:
					return usagef("dropping %s%s deletes the %d messages waiting for it; repeat with --yes to do it", group, onTopic(topic), waiting)
				}
				window := *stale
				if force {
					window = 0
				}
				dropped, err := c.DropConsumerGroups(cmd.Context(), delivery.GroupDrop{ConsumerGroup: group, Topic: topic, UnlessSeenWithin: window})
				if errors.As(err, &alive) {
					return refuseRunning(alive, *stale)
				}
				if err != nil {
					return err
				}
				for _, d := range dropped {
					fmt.Fprintf(cmd.OutOrStdout(), "dropped %s of %s (%d messages deleted)\n", group, d.Topic, d.Messages)
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&topic, "topic", "", "only of this topic (default: every topic the group reads)")
	cmd.Flags().BoolVar(&yes, "yes", false, "confirm: the messages waiting for the group are deleted")
	cmd.Flags().BoolVar(&force, "force", false, "drop the group even if a worker showed it alive within --stale")
	return cmd
}

// refuseRunning is the refusal to drop a group a worker showed alive
// within stale.
func refuseRunning(alive *delivery.ConsumerGroupAliveError, stale time.Duration) error {
	return fmt.Errorf("consumer group %s of %s runs: a worker showed it alive %s ago (%s), within --stale %s; dropping it would delete "+
		"what waits for its workers. Stop them first, or repeat with --force", alive.ConsumerGroup, strings.Join(alive.Topics, ", "),
		present.Age(alive.Ago), alive.LastSeen.Format(time.RFC3339), stale)
}

func onTopic(topic string) string {
	if topic == "" {
		return ""
	}
	return " of topic " + topic
}
