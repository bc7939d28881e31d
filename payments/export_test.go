package payments

import (
	"context"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/steps"
)

// CaptureUnder runs the capture phase of a charge (the gateway call and the
// recording of its answer) under lease. Tests use it to stage a capture the
// reserve phase would never start, to pin the guards of the recording itself.
func (s *Service) CaptureUnder(ctx context.Context, lease *idempotency.Lease, cmd ChargePayment) (string, error) {
	return s.capture(ctx, lease, cmd)
}

// ChargeStepOn is the charge step, served by s, on topic instead of
// ChargeTopic.
func (s *Service) ChargeStepOn(topic string) steps.Step[ChargePayment] {
	return steps.Define(ChargeStepName, topic, s.charge)
}

// RefundStepOn is the refund step, served by s, on topic instead of
// RefundTopic.
func (s *Service) RefundStepOn(topic string) steps.Step[RefundPayment] {
	return steps.Define(RefundStepName, topic, s.refund)
}

// KeepNoAnswers makes s read the record of every awaited gateway call
// back, as a process that did not make the call does.
func KeepNoAnswers(s *Service) {
	s.answers.mu.Lock()
	defer s.answers.mu.Unlock()
	s.answers.off = true
}

// Kept reports whether s keeps an answer for the gateway call of key.
func Kept(s *Service, key string) bool {
	s.answers.mu.Lock()
	defer s.answers.mu.Unlock()
	_, ok := s.answers.m[key]
	return ok
}
