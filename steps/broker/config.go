package broker

import (
	"context"
	"log/slog"
)

// Defaults of Config.
const (
	GroupDefault     = "pgsaga"
	ConsumersDefault = 2
	BatchSizeDefault = 100
)

// Config configures a client's bridge to a message broker
// (saga.ClientConfig.Broker): the database's outbox is relayed to the
// broker (Relay), its queues take what is received (Receive). Zero values
// take the defaults.
type Config struct {
	// Broker is the message broker. Required. The bridge does not close
	// it.
	Broker Broker
	// Relay lists the topics relayed from this database to the broker.
	Relay []string
	// Receive lists the topics taken in from the broker into this
	// database, for the consumer groups that read them here (a step's, the
	// saga engine's). A topic cannot be both relayed and received by one
	// database: it would go round in circles.
	Receive []string
	// Group names this database's consumer group at the broker, for the
	// received topics. Every service (every database) that receives a
	// topic needs a group of its own; processes of one service share
	// theirs. Default: GroupDefault.
	Group string
	// Consumers is how many consumers of each received topic this process
	// runs, each queuing one message at a time. Default: ConsumersDefault.
	Consumers int
	// BatchSize is how many messages of a topic the relay takes from the
	// queue per transaction. Default: BatchSizeDefault.
	BatchSize int
	// Faults inject failures, for tests. Default: none.
	Faults Faults
	// Logger. Default: the client's.
	Logger *slog.Logger
}

// Stats counts what a bridge did since it was built.
type Stats struct {
	// Relayed counts the messages the broker took from the relay (in
	// batches that committed); Received those queued from the broker (a
	// redelivery counts again); DeadLettered those either side
	// dead-lettered; HandedBack those received that the database did not
	// take then, handed back to the broker for redelivery.
	Relayed, Received, DeadLettered, HandedBack int64
}

// Bridge is a client's running bridge to its broker, from
// saga.Client.Bridge: Start and Stop run it (Client.Start and Stop do, for
// a client that runs its own worker), and Stats counts what it did.
type Bridge interface {
	// Start provisions the topics at the broker, then runs the relay and
	// the inbox until Stop. A second Start is ErrStarted.
	Start(ctx context.Context) error
	// Stop stops the bridge and waits for what it runs.
	Stop() error
	// Stats returns what the bridge did so far.
	Stats() Stats
}
