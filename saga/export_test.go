package saga

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// The engine's handlers, for the tests that drive an Engine directly
// (a Client wires them itself).

func (e *Engine) AddHandlers(r *transport.Router, opts ...transport.HandlerOption) error {
	return e.addHandlers(r, opts...)
}

func (e *Engine) HandleReply(msg *message.Message) error { return e.handleReply(msg) }

// The engine and the operator calls the Client wraps, for the tests that
// drive them directly.
type (
	Engine            = engine
	Config            = engineConfig
	SweepResult       = sweepResult
	PruneResult       = pruneResult
	UnknownDefinition = unknownDefinition
)

var (
	NewEngine       = newEngine
	Ask             = ask
	RequestStatus   = requestStatus
	RequestStatuses = requestStatuses
	CountSelected   = countSelected
	SelectedIDs     = selectedIDs
)

// CollectTimeout bounds one scrape of the collector.
const CollectTimeout = collectTimeout
