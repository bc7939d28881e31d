package orderpayment_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// spans indexes the spans an in-memory exporter holds.
type spans struct {
	all  tracetest.SpanStubs
	byID map[trace.SpanID]tracetest.SpanStub
}

func exported(exp *tracetest.InMemoryExporter) spans {
	s := spans{all: exp.GetSpans(), byID: map[trace.SpanID]tracetest.SpanStub{}}
	for _, sp := range s.all {
		s.byID[sp.SpanContext.SpanID()] = sp
	}
	return s
}

func attr(sp tracetest.SpanStub, key attribute.Key) string {
	for _, a := range sp.Attributes {
		if a.Key == key {
			return a.Value.Emit()
		}
	}
	return ""
}

// ofSaga returns the trace of saga id: every span that names the saga
// must be in it, and the trace must hang together: one root, every other
// span's parent exported in the same trace.
func (s spans) ofSaga(t *testing.T, id uuid.UUID) []tracetest.SpanStub {
	t.Helper()
	traces := map[trace.TraceID]bool{}
	for _, sp := range s.all {
		if attr(sp, telemetry.AttrSagaID) == id.String() {
			traces[sp.SpanContext.TraceID()] = true
		}
	}
	require.Len(t, traces, 1, "one saga, one trace")
	var tid trace.TraceID
	for k := range traces {
		tid = k
	}
	var out []tracetest.SpanStub
	roots := 0
	for _, sp := range s.all {
		if sp.SpanContext.TraceID() != tid {
			continue
		}
		out = append(out, sp)
		if !sp.Parent.IsValid() {
			roots++
			continue
		}
		_, ok := s.byID[sp.Parent.SpanID()]
		assert.True(t, ok, "the parent of %q was exported", sp.Name)
		assert.Equal(t, tid, sp.Parent.TraceID(), "%q's parent is in the saga's trace", sp.Name)
	}
	assert.Equal(t, 1, roots, "one root")
	return out
}

// chain names the spans from sp up to its trace's root, root first.
func (s spans) chain(sp tracetest.SpanStub) []string {
	var names []string
	for {
		names = append([]string{sp.Name}, names...)
		parent, ok := s.byID[sp.Parent.SpanID()]
		if !sp.Parent.IsValid() || !ok {
			return names
		}
		sp = parent
	}
}

// final is the decision that ended the saga.
func final(t *testing.T, trace []tracetest.SpanStub, status saga.Status) tracetest.SpanStub {
	t.Helper()
	var found []tracetest.SpanStub
	for _, sp := range trace {
		if strings.HasPrefix(sp.Name, "saga ") && attr(sp, telemetry.AttrStatus) == string(status) && attr(sp, telemetry.AttrFrom) != string(status) {
			found = append(found, sp)
		}
	}
	require.Len(t, found, 1, "one decision ended the saga %s", status)
	return found[0]
}

// A whole saga is one trace: every publish, delivery attempt, step attempt
// and engine decision, parent to child from the first to the last, through
// the queue and in process; a decision no message led to (an operator's
// cancel) joins the saga's trace through the instance.
func TestOneSagaIsOneTrace(t *testing.T) {
	t.Parallel()
	def, err := saga.Define(orderpayment.Spec(orderpayment.Steps(orderpayment.StepTimeouts{})))
	require.NoError(t, err)
	trigger, replies := def.Trigger, def.ReplyTopic
	hop := func(topic string) []string { return []string{"send " + topic, "process " + topic} }
	join := func(parts ...[]string) []string {
		var out []string
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	decision := func(d string) []string { return []string{"saga " + d + " " + orderpayment.Name} }
	step := func(name string) []string { return []string{"step " + name} }

	for _, queued := range []bool{false, true} {
		t.Run(fmt.Sprintf("every hop queued %v", queued), func(t *testing.T) {
			t.Parallel()
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
			e := newEnv(t, 0, func(c *orderpayment.Config) {
				c.QueueEveryHop = queued
				c.Transport.TracerProvider = tp
			})
			cust := e.customer(100_000)
			_, paid := e.place(cust, 2_000)
			cancelledOrder, refunded := e.place(cust, 3_000)
			require.NoError(t, e.app.Orders.CancelByCustomer(context.Background(), cancelledOrder, "changed my mind"))
			var operatorCancelled uuid.UUID
			if !queued {
				// Started in Place's transaction, its charge queued: an
				// operator cancels it before any worker runs.
				_, operatorCancelled = e.place(cust, 1_000)
				require.NoError(t, e.app.Client.Cancel(context.Background(), operatorCancelled, "test"))
			}
			e.startWorker()
			e.terminal(paid)
			e.terminal(refunded)
			s := exported(exp)

			// The paid saga, hop by hop: the charge, then the confirmation.
			start := decision("start")
			if queued {
				start = join(hop(trigger), start)
			}
			want := join(start,
				hop(payments.ChargeTopic), step("payments.charge"), hop(replies), decision("reply"),
				hop(orders.ConfirmTopic), step("orders.confirm"), hop(replies), decision("reply"))
			paidTrace := s.ofSaga(t, paid)
			got := s.chain(final(t, paidTrace, saga.StatusCompleted))
			assert.Equal(t, want, got)
			// The charge's first run awaits its gateway call: neither that
			// step span nor its delivery's is an error, nor is any other.
			awaiting := 0
			for _, sp := range paidTrace {
				assert.NotEqual(t, codes.Error, sp.Status.Code, "%s: %s", sp.Name, sp.Status.Description)
				if attr(sp, telemetry.AttrOutcome) == telemetry.StepAwaiting {
					awaiting++
				}
			}
			assert.Positive(t, awaiting, "the charge's spans say it awaited its call")

			// The refunded one: confirmation refused, refund, cancel.
			want = join(start,
				hop(payments.ChargeTopic), step("payments.charge"), hop(replies), decision("reply"),
				hop(orders.ConfirmTopic), step("orders.confirm"), hop(replies), decision("reply"),
				hop(payments.RefundTopic), step("payments.refund"), hop(replies), decision("reply"),
				hop(orders.CancelTopic), step("orders.cancel"), hop(replies), decision("reply"))
			got = s.chain(final(t, s.ofSaga(t, refunded), saga.StatusCompensated))
			assert.Equal(t, want, got)

			var stored string
			require.NoError(t, e.db.SQL.QueryRow(`SELECT trace_parent FROM saga_instances WHERE id = $1`, paid).Scan(&stored))
			assert.Contains(t, stored, paidTrace[0].SpanContext.TraceID().String(), "the instance keeps its trace")

			if !queued {
				e.terminal(operatorCancelled)
				s = exported(exp)
				cancelTrace := s.ofSaga(t, operatorCancelled)
				var cancel []tracetest.SpanStub
				for _, sp := range cancelTrace {
					if sp.Name == "saga cancel "+orderpayment.Name {
						cancel = append(cancel, sp)
					}
				}
				require.Len(t, cancel, 1)
				assert.Equal(t, join(decision("start"), decision("cancel")), s.chain(cancel[0]),
					"an operator's cancel is a child of the saga's first decision")
				got := s.chain(final(t, cancelTrace, saga.StatusCompensated))
				assert.Equal(t, join(decision("start"), decision("cancel"), hop(payments.RefundTopic), step("payments.refund"), hop(replies), decision("reply"),
					hop(orders.CancelTopic), step("orders.cancel"), hop(replies), decision("reply")), got)
			}
		})
	}
}
