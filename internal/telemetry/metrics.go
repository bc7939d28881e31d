// Package telemetry holds what pgsaga tells the outside about its work:
// Prometheus metrics (Metrics) and OpenTelemetry traces (see Tracing).
// Both are off until a program asks: a nil *Metrics records nothing, and
// spans go to the global tracer provider, which exports nothing unless one
// is installed.
package telemetry

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Namespace prefixes every metric pgsaga exports.
const Namespace = "pgsaga"

// Outcomes of a step attempt, the outcome label of
// pgsaga_step_duration_seconds.
const (
	StepCompleted = "completed" // the handler answered; the key is stored completed
	StepFailed    = "failed"    // a business failure, stored and answered
	StepReplayed  = "replayed"  // a duplicate answered from the store
	StepError     = "error"     // the attempt failed and was rolled back (retried or dead-lettered)
	// StepAwaiting: the handler awaits a call outside the transaction
	// (steps.Await); its run after the call answers. Not a failure.
	StepAwaiting = "awaiting"
	// StepHandedBack: the attempt handed its message back untouched (its
	// key is another's for now). Not a failure.
	StepHandedBack = "handed_back"
)

// Metrics are the counters and histograms a pgsaga process keeps of its own
// work. Everything is counted when the transaction that did it commits (see
// transport.OnCommit), so a rolled-back attempt counts only as an error;
// work done in a caller's own transaction (Client.StartTx, RetryTx and
// CancelTx) is counted when pgsaga returns, as pgsaga cannot see that
// commit. A nil *Metrics records nothing.
//
// The transport builds them (NewMetrics) from the registerer in
// transport.Config.Metrics (for a saga.Client: ClientConfig.Transport.
// Metrics). What is in the database rather than in one process's memory
// (sagas in flight, what waits in each consumer group) is read at scrape
// time by saga.Client.Collector.
type Metrics struct {
	sagasStarted  *prometheus.CounterVec
	sagasFinished *prometheus.CounterVec
	sagaDuration  *prometheus.HistogramVec
	resent        *prometheus.CounterVec
	stepDuration  *prometheus.HistogramVec
	stepAttempts  *prometheus.HistogramVec
	replays       *prometheus.CounterVec
	deadLetters   *prometheus.CounterVec
	retries       *prometheus.CounterVec
	handedBack    *prometheus.CounterVec
	relayed       *prometheus.CounterVec
	relayFailures *prometheus.CounterVec
	received      *prometheus.CounterVec
	receiveErrors *prometheus.CounterVec
}

// NewMetrics builds the metrics and registers them with reg
// (prometheus.DefaultRegisterer, or a registry of your own). Metrics reg
// already holds (registered by another transport of the process) are
// shared: both count into them.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil || isNilPointer(reg) {
		return nil, errors.New("telemetry: NewMetrics needs a Registerer")
	}
	m := &Metrics{
		sagasStarted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "sagas_started_total",
			Help: "Saga instances started by this process.",
		}, []string{"saga"}),
		sagasFinished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "sagas_finished_total",
			Help: "Saga instances this process brought to a terminal state, by outcome (completed, compensated, failed: parked for an operator). A parked saga retried by an operator counts again when it ends.",
		}, []string{"saga", "outcome"}),
		sagaDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "saga_duration_seconds",
			Help:    "Time a saga instance took from its start to the terminal state this process brought it to, on the database's clock, by outcome (completed, compensated, failed).",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600, 21600, 86400},
		}, []string{"saga", "outcome"}),
		resent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "saga_commands_resent_total",
			Help: "Saga commands sent again because their reply was overdue (the deadline sweeper) or an operator retried them, by saga and the saga's step (saga_step; step is a participant's step elsewhere).",
		}, []string{"saga", "saga_step"}),
		stepDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "step_duration_seconds",
			Help:    "Time a step attempt took, from its claim of the command's key to its reply, by outcome (completed, failed, replayed, error).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"step", "outcome"}),
		stepAttempts: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "step_attempts",
			Help:    "Delivery attempts a step's command took until it was answered (1: the first).",
			Buckets: []float64{1, 2, 3, 4, 5, 7, 10, 15, 20},
		}, []string{"step"}),
		replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "idempotent_replays_total",
			Help: "Duplicate commands answered from the idempotency store instead of running again.",
		}, []string{"step"}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "dead_letters_total",
			Help: "Messages this process moved to pgsaga_dead_letters, by topic and handler.",
		}, []string{"topic", "handler"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "delivery_retries_total",
			Help: "Failed delivery attempts scheduled to be tried again after their backoff, by topic and handler.",
		}, []string{"topic", "handler"}),
		handedBack: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "delivery_handed_back_total",
			Help: "Messages a handler of this process handed back untouched, no attempt counted, for another process of its consumer group (a saga reply or request of a definition version this process does not know, during a rolling deploy), by topic and handler.",
		}, []string{"topic", "handler"}),
		relayed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "broker_relayed_total",
			Help: "Messages this process relayed from the outbox to the message broker, by topic, counted when the relay's batch committed.",
		}, []string{"topic"}),
		relayFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "broker_relay_failures_total",
			Help: "Relay batches of a topic that stopped at a publish the broker did not take (or could not commit); the head is tried again after a backoff.",
		}, []string{"topic"}),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "broker_received_total",
			Help: "Messages this process took in from the message broker and queued in its database, by topic (a broker's redelivery counts again).",
		}, []string{"topic"}),
		receiveErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "broker_receive_errors_total",
			Help: "Messages from the broker this process could not queue and handed back for redelivery (the database did not take them), by topic.",
		}, []string{"topic"}),
	}
	// What this call registered, unregistered again if a later one fails:
	// a refused NewMetrics leaves reg as it was.
	var added []prometheus.Collector
	fail := func(err error) (*Metrics, error) {
		for _, c := range added {
			reg.Unregister(c)
		}
		return nil, err
	}
	for _, c := range []**prometheus.CounterVec{&m.sagasStarted, &m.sagasFinished, &m.resent, &m.replays, &m.deadLetters, &m.retries, &m.handedBack,
		&m.relayed, &m.relayFailures, &m.received, &m.receiveErrors} {
		if err := register(reg, c, &added); err != nil {
			return fail(err)
		}
	}
	for _, h := range []**prometheus.HistogramVec{&m.sagaDuration, &m.stepDuration, &m.stepAttempts} {
		if err := register(reg, h, &added); err != nil {
			return fail(err)
		}
	}
	return m, nil
}

// register registers *c with reg, adding it to added, or, if reg holds
// the same metric already (same kind, name, help and labels in the same
// order, as another NewMetrics registered it), points *c at that one.
// Labels in another order are refused: values would land under the wrong
// names.
func register[C prometheus.Collector](reg prometheus.Registerer, c *C, added *[]prometheus.Collector) error {
	err := reg.Register(*c)
	var dup prometheus.AlreadyRegisteredError
	if errors.As(err, &dup) {
		if existing, ok := dup.ExistingCollector.(C); ok && sameDescs(existing, *c) {
			*c = existing
			return nil
		}
		err = fmt.Errorf("%w: %s is registered already, otherwise", err, describe(*c))
	}
	if err != nil {
		return fmt.Errorf("telemetry: registering metrics: %w", err)
	}
	*added = append(*added, *c)
	return nil
}

// sameDescs reports whether a and b describe the same metrics, variable
// labels in the same order.
func sameDescs(a, b prometheus.Collector) bool {
	return describe(a) == describe(b)
}

// describe is c's descriptions, in order.
func describe(c prometheus.Collector) string {
	ch := make(chan *prometheus.Desc, 4)
	go func() { c.Describe(ch); close(ch) }()
	var out []string
	for d := range ch {
		out = append(out, d.String())
	}
	return strings.Join(out, "; ")
}

// isNilPointer reports whether reg is a typed nil pointer (a nil
// *prometheus.Registry, say), which would panic when used.
func isNilPointer(reg prometheus.Registerer) bool {
	v := reflect.ValueOf(reg)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// SagaStarted counts an instance of saga started.
func (m *Metrics) SagaStarted(saga string) {
	if m != nil {
		m.sagasStarted.WithLabelValues(saga).Inc()
	}
}

// Millis is d in milliseconds, to the microsecond: how pgsaga's log
// records write durations (under keys ending in _ms), whatever the
// handler's format.
func Millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// SagaFinished counts an instance of saga that reached a terminal state,
// took after its start (on the database's clock).
func (m *Metrics) SagaFinished(saga, outcome string, took time.Duration) {
	if m != nil {
		m.sagasFinished.WithLabelValues(saga, outcome).Inc()
		m.sagaDuration.WithLabelValues(saga, outcome).Observe(max(took, 0).Seconds())
	}
}

// CommandResent counts a command of sagaStep, a step of saga, sent again.
func (m *Metrics) CommandResent(saga, sagaStep string) {
	if m != nil {
		m.resent.WithLabelValues(saga, sagaStep).Inc()
	}
}

// StepAttempt records one attempt of step: how long it took and how it
// ended (StepCompleted, StepFailed, StepReplayed, StepError, StepAwaiting,
// StepHandedBack). attempt is
// the delivery attempt's number; it goes to pgsaga_step_attempts when the
// command was answered by running the step (completed or failed).
func (m *Metrics) StepAttempt(step, outcome string, took time.Duration, attempt int) {
	if m == nil {
		return
	}
	m.stepDuration.WithLabelValues(step, outcome).Observe(took.Seconds())
	switch outcome {
	case StepCompleted, StepFailed:
		if attempt > 0 {
			m.stepAttempts.WithLabelValues(step).Observe(float64(attempt))
		}
	case StepReplayed:
		m.replays.WithLabelValues(step).Inc()
	}
}

// DeadLettered counts a message moved to pgsaga_dead_letters.
func (m *Metrics) DeadLettered(topic, handler string) {
	if m != nil {
		m.deadLetters.WithLabelValues(topic, handler).Inc()
	}
}

// Retrying counts a failed attempt whose message will be tried again.
func (m *Metrics) Retrying(topic, handler string) {
	if m != nil {
		m.retries.WithLabelValues(topic, handler).Inc()
	}
}

// HandedBack counts a message of topic that handler handed back untouched
// (transport.HandBack).
func (m *Metrics) HandedBack(topic, handler string) {
	if m != nil {
		m.handedBack.WithLabelValues(topic, handler).Inc()
	}
}

// Relayed counts n messages of topic relayed to the broker.
func (m *Metrics) Relayed(topic string, n int) {
	if m != nil && n > 0 {
		m.relayed.WithLabelValues(topic).Add(float64(n))
	}
}

// RelayFailed counts a relay batch of topic stopped by a failure.
func (m *Metrics) RelayFailed(topic string) {
	if m != nil {
		m.relayFailures.WithLabelValues(topic).Inc()
	}
}

// Received counts a message of topic taken in from the broker.
func (m *Metrics) Received(topic string) {
	if m != nil {
		m.received.WithLabelValues(topic).Inc()
	}
}

// ReceiveFailed counts a message of topic handed back to the broker
// because it could not be queued.
func (m *Metrics) ReceiveFailed(topic string) {
	if m != nil {
		m.receiveErrors.WithLabelValues(topic).Inc()
	}
}
