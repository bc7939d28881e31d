package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/internal/bridge"
	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// envBrokerURL is the environment variable that gives relay its broker
// when --broker is not given.
const envBrokerURL = "PGSAGA_BROKER_URL"

func relayCmd() *cobra.Command {
	var (
		brokerURL string
		topics    []string
		batch     int
		every     time.Duration
		serving   serveFlags
	)
	cmd := &cobra.Command{
		Use:   "relay --broker URL --topic T [--topic T…]",
		Short: "Relay topics from the workers' database to a message broker, in order, until Ctrl-C",
		Long: "relay runs the outbox relay as a process of its own: every message published to one of the topics in the " +
			"workers' database is published to the broker (" + brokers.Schemes + "), at least once, in the order it was " +
			"queued, with its UUID as the broker's deduplication id. It records the relay's consumer group of each topic " +
			"first (messages published to a topic before any relay or group subscribed it are dead letters), creates the " +
			"topics at the broker if missing, and runs until SIGINT or SIGTERM. Several relays of one topic take turns. " +
			"Workers can run the relay themselves instead (saga.ClientConfig.Broker). The broker URL may hold a password: give it in " +
			"the environment, " + envBrokerURL + ", rather than as --broker, which every user of the machine can read on the " +
			"command line (--broker, given, wins).",
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("broker") {
				brokerURL = os.Getenv(envBrokerURL)
			}
			if brokerURL == "" {
				return usagef("--broker is required (or %s in the environment): %s", envBrokerURL, brokers.Schemes)
			}
			if err := brokers.Check(brokerURL); err != nil {
				return usageError{err}
			}
			if len(topics) == 0 {
				return usagef("give at least one --topic to relay")
			}
			for _, t := range topics {
				if err := transport.ValidateTopic(t); err != nil {
					return usageError{err}
				}
			}
			if batch < 1 || batch > 1000 {
				return usagef("--batch must be between 1 and 1000, got %d", batch)
			}
			if every < 0 {
				return usagef("--report-every must not be negative")
			}
			stderr := cmd.ErrOrStderr()
			log, err := serving.logger(cmd.Flags(), stderr)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			return onFound(ctx, true, relayConns(len(topics)), func(db *pgdb.DB, found target) error {
				reg, stop, err := serving.serve(ctx, "relay", stderr, log)
				if err != nil {
					return err
				}
				defer stop()
				tr, err := transport.New(transport.Config{DB: db.SQL, Logger: log, Metrics: registerer(reg)})
				if err != nil {
					return err
				}
				if reg != nil {
					c, err := operatorClient(db.SQL, log)
					if err != nil {
						return err
					}
					reg.MustRegister(c.Collector()) // the relay's lag: pgsaga_consumer_depth{consumer_group="pgsaga.relay"}
				}
				br, err := brokers.Open(brokerURL, log)
				if err != nil {
					return err
				}
				defer br.Close()
				b, err := bridge.New(tr, broker.Config{Broker: br, Relay: topics, BatchSize: batch, Logger: log})
				if err != nil {
					return usageError{err}
				}
				startCtx, cancel := context.WithTimeout(ctx, time.Minute)
				err = b.Start(startCtx)
				cancel()
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "pgsaga relay: relaying %v from %s to %s; stop with Ctrl-C (SIGINT) or SIGTERM\n", topics, found.describe(), brokerurl.Describe(brokerURL))
				var tick <-chan time.Time
				if every > 0 {
					t := time.NewTicker(every)
					defer t.Stop()
					tick = t.C
				}
				last := b.Stats()
				for running := true; running; {
					select {
					case <-ctx.Done():
						running = false
					case <-tick:
						now := b.Stats()
						fmt.Fprintf(cmd.OutOrStdout(), "pgsaga relay: %d relayed in the last %s (%d in all), %d dead-lettered in all\n",
							now.Relayed-last.Relayed, every, now.Relayed, now.DeadLettered)
						last = now
					}
				}
				stopErr := b.Stop()
				st := b.Stats()
				fmt.Fprintf(cmd.OutOrStdout(), "pgsaga relay: stopped; %d relayed, %d dead-lettered\n", st.Relayed, st.DeadLettered)
				return stopErr
			})
		},
	}
	cmd.Flags().StringVar(&brokerURL, "broker", "", "the broker: "+brokers.Schemes+" (default $"+envBrokerURL+")")
	cmd.Flags().StringArrayVar(&topics, "topic", nil, "a topic to relay (repeat for several)")
	cmd.Flags().IntVar(&batch, "batch", broker.BatchSizeDefault, "messages of a topic taken from the queue per transaction")
	cmd.Flags().DurationVar(&every, "report-every", time.Minute, "print what was relayed this often (0: only when stopping)")
	serving.register(cmd.Flags(), "log each batch")
	return cmd
}

// relayConns is the pool of a relay of n topics: a batch of each at once,
// the wake-up listener, the heartbeat, and one for the start's statements.
func relayConns(n int) int32 { return int32(n) + 3 }
