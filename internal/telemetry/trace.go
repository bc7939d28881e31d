package telemetry

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgsaga/pgsaga/internal/metadata"
)

// TracerName is the instrumentation scope of pgsaga's spans.
const TracerName = "github.com/pgsaga/pgsaga"

// Span attribute keys pgsaga sets, besides OpenTelemetry's messaging ones.
const (
	AttrHandler   = attribute.Key("pgsaga.handler")
	AttrAttempt   = attribute.Key("pgsaga.attempt")
	AttrInProcess = attribute.Key("pgsaga.in_process")
	AttrStep      = attribute.Key("pgsaga.step")
	AttrKey       = attribute.Key("pgsaga.idempotency_key")
	AttrOutcome   = attribute.Key("pgsaga.outcome")
	AttrSaga      = attribute.Key("pgsaga.saga")
	AttrSagaID    = attribute.Key("pgsaga.saga_id")
	AttrDecision  = attribute.Key("pgsaga.decision")
	AttrStatus    = attribute.Key("pgsaga.status")
	AttrFrom      = attribute.Key("pgsaga.from_status")
)

// Tracing makes pgsaga's spans and carries their context from a message's
// publisher to its handlers, in the message's metadata (traceparent,
// tracestate): every publish, delivery attempt, step attempt and saga
// engine decision is a span, and one saga is one trace across every hop
// and process. The zero value is not usable: build it with NewTracing.
type Tracing struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
}

// NewTracing returns the tracing of spans made by tp's tracer; nil tp
// takes the global provider (otel.GetTracerProvider), which exports
// nothing until a program installs one. The trace context travels as W3C
// Trace Context whatever the global propagator is, so that processes
// configured differently still join their traces.
func NewTracing(tp trace.TracerProvider) *Tracing {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return &Tracing{tracer: tp.Tracer(TracerName), prop: propagation.TraceContext{}}
}

// Tracer is the tracer of pgsaga's spans.
func (t *Tracing) Tracer() trace.Tracer { return t.tracer }

// Start starts a span as a child of ctx's.
func (t *Tracing) Start(ctx context.Context, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return t.tracer.Start(ctx, name, trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
}

// Inject writes the trace context of ctx into md; it leaves md alone when
// ctx holds no span that is recorded or sampled remotely.
func (t *Tracing) Inject(ctx context.Context, md message.Metadata) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	t.prop.Inject(ctx, carrier(md))
}

// Extract returns ctx with the remote span context md carries, if any.
func (t *Tracing) Extract(ctx context.Context, md message.Metadata) context.Context {
	if md.Get(metadata.TraceParent) == "" {
		return ctx
	}
	return t.prop.Extract(ctx, carrier(md))
}

// End ends span, marking it failed with err if err is not nil.
func End(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// carrier is message metadata as a propagation.TextMapCarrier.
type carrier message.Metadata

func (c carrier) Get(key string) string { return c[key] }
func (c carrier) Set(key, value string) { c[key] = value }
func (c carrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// ContextWithRemote returns ctx with the span context encoded in
// traceparent (and tracestate) as its remote parent: for work that
// continues a trace recorded outside any message (a saga's, stored with
// its instance). Nothing changes for an empty or malformed traceparent.
func (t *Tracing) ContextWithRemote(ctx context.Context, traceparent, tracestate string) context.Context {
	if traceparent == "" {
		return ctx
	}
	md := message.Metadata{metadata.TraceParent: traceparent}
	if tracestate != "" {
		md[metadata.TraceState] = tracestate
	}
	return t.prop.Extract(ctx, carrier(md))
}

// TraceParent returns the W3C traceparent of ctx's span, "" if it has none.
func (t *Tracing) TraceParent(ctx context.Context) string {
	md := message.Metadata{}
	t.Inject(ctx, md)
	return md[metadata.TraceParent]
}

// LogIDs are the trace_id and span_id log attributes of the span in ctx,
// none when ctx has no valid span: a log record written under a span
// names it, so that logs and traces join.
func LogIDs(ctx context.Context) []any {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return nil
	}
	return []any{"trace_id", sc.TraceID().String(), "span_id", sc.SpanID().String()}
}
