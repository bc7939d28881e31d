// Package unittier lets the test kit (saga/sagatest) run a saga's
// transitions in a transaction that is rolled back, through a client,
// without an API of the client's for it: package saga sets Transitions
// when it is loaded.
package unittier

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/saga/delivery"
	"github.com/pgsaga/pgsaga/steps"
)

// Reply is a participant's answer to the command in flight.
type Reply struct {
	Message steps.Message // nil with Failed: a steps.FailureReply
	Failed  bool
	Reason  string
}

// Transition is a saga after one reaction, in the transaction.
type Transition struct {
	Instance any              // a saga.Instance
	Command  *message.Message // the command the reaction sent; nil if none
}

// Step runs step once for msg through client's step
// runtime, in a transaction it rolls back once inspect has seen it. The
// step's failure is stepErr; anything else that stopped it is err.
var Step func(ctx context.Context, client any, step steps.AnyStep, msg *message.Message, inspect func(tx delivery.DBTX) error) (stepErr, err error)

// Transitions starts saga name from trigger, then answers its command in
// flight with each of replies in turn, in one transaction of client's that
// it rolls back; observe sees the saga after each reaction, in that
// transaction. A reaction's failure (the engine's) is reactionErr;
// anything else that stopped the run (the database, observe, a reply
// with no command to answer, a saga of that key existing or being run
// already) is err.
var Transitions func(ctx context.Context, client any, name string, trigger steps.Message, replies []Reply,
	observe func(tx delivery.DBTX, t Transition) error) (reactionErr, err error)
