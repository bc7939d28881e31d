package transport

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgsaga/pgsaga/internal/telemetry"
)

// The messaging.system of pgsaga's spans (OpenTelemetry's semantic
// conventions name no such system: pgsaga's own queue).
var attrSystem = semconv.MessagingSystemKey.String("pgsaga")

// notFailed reports whether err, returned by a handler, ends its attempt
// without failing it: it awaits a call (Await) or hands its message back
// (HandBack). Such an attempt's span is not an error; its outcome says
// which (telemetry.AttrOutcome).
func notFailed(err error) (outcome string, ok bool) {
	switch {
	case IsAwait(err):
		return telemetry.StepAwaiting, true
	case IsHandBack(err):
		return telemetry.StepHandedBack, true
	}
	return "", false
}

// traced wraps h, a handler of topic named name, in a span of each
// attempt: "process <topic>", a child of the span whose context the
// message carries (its publish), and the parent of what the handler does
// and publishes. A handler that panics ends its span as failed (and panics
// on, to the transport's recovery).
func (t *Transport) traced(name, group, topic string, h HandlerFunc) HandlerFunc {
	return func(msg *message.Message) (err error) {
		ctx := msg.Context()
		ctx = t.trace.Extract(ctx, msg.Metadata)
		ctx, span := t.trace.Start(ctx, "process "+topic, trace.SpanKindConsumer)
		if span.IsRecording() { // tracing off costs no attributes
			span.SetAttributes(attrSystem, semconv.MessagingDestinationName(topic), semconv.MessagingMessageID(msg.UUID),
				semconv.MessagingConsumerGroupName(group), semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process"),
				telemetry.AttrHandler.String(name), telemetry.AttrAttempt.Int(AttemptFromContext(ctx)),
				telemetry.AttrInProcess.Bool(InProcessFromContext(ctx)))
		}
		defer func() {
			if p := recover(); p != nil {
				telemetry.End(span, fmt.Errorf("%w: %v", ErrHandlerPanicked, p))
				panic(p)
			}
			if outcome, ok := notFailed(err); ok {
				span.SetAttributes(telemetry.AttrOutcome.String(outcome))
				telemetry.End(span, nil)
				return
			}
			telemetry.End(span, err)
		}()
		if span.SpanContext().IsValid() {
			msg.SetContext(ctx)
			if a, ok := ctx.Value(txKey{}).(*attemptTx); ok {
				a.traceCtx.Store(&ctx)
			}
		}
		return h(msg)
	}
}

// wrap is how the transport runs a handler: traced, inside the
// Intercept of the transport, if any.
func (t *Transport) wrap(name, group, topic string, h HandlerFunc) HandlerFunc {
	if t.cfg.Intercept != nil {
		h = t.cfg.Intercept(name, h)
	}
	return t.traced(name, group, topic, h)
}

// traceSend records the publish of msg to topic, through tx, as a span
// "send <topic>" and puts its context into the message's metadata. Its
// parent is the span of msg's context, else that of the delivery attempt
// publishing it.
func (t *Transport) traceSend(tx Tx, topic string, msg *message.Message) {
	ctx := msg.Context()
	if !trace.SpanContextFromContext(ctx).IsValid() {
		if a, ok := tx.(*attemptTx); ok {
			if actx := a.traceCtx.Load(); actx != nil {
				ctx = *actx
			}
		}
	}
	ctx, span := t.trace.Start(ctx, "send "+topic, trace.SpanKindProducer)
	if span.IsRecording() {
		span.SetAttributes(attrSystem, semconv.MessagingDestinationName(topic), semconv.MessagingMessageID(msg.UUID),
			semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("send"))
	}
	if span.SpanContext().IsValid() {
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		t.trace.Inject(ctx, msg.Metadata)
	}
	span.End()
}

// traceCtx is the context of the span of the attempt's handler (see
// traced), for what it publishes with no span of its own.
type traceCtx = atomic.Pointer[context.Context]
