package payments

import (
	"context"

	"github.com/pgsaga/pgsaga/idempotency"
)

// CaptureUnder runs the capture phase of a charge (the gateway call and the
// recording of its answer) under lease. Tests use it to stage a capture the
// reserve phase would never start, to pin the guards of the recording itself.
func (s *Service) CaptureUnder(ctx context.Context, lease *idempotency.Lease, cmd ChargePayment) (string, error) {
	return s.capture(ctx, lease, cmd)
}
