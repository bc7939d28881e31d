package payments

import "errors"

// The errors the package returns, for errors.Is.
var (
	// ErrInvalidAccountID is returned by OpenAccount for an id that is not
	// an account id (1 to 64 letters, digits, '_', '.' or '-').
	ErrInvalidAccountID = errors.New("payments: invalid account id")
	// ErrUnknownAccount is returned when a deposit or a charge names an
	// account that was never opened.
	ErrUnknownAccount = errors.New("payments: unknown account")
	// ErrInvalidAmount is returned by Deposit for an amount that is not
	// positive.
	ErrInvalidAmount = errors.New("payments: amount must be positive")
	// ErrDeclined is returned by the gateway client when the gateway
	// refused the operation: final, the charge fails.
	ErrDeclined = errors.New("payments: declined by the gateway")
	// ErrBadGatewayRequest is returned by the gateway client when the
	// gateway will never accept the request (a 4xx other than a decline):
	// retrying cannot help.
	ErrBadGatewayRequest = errors.New("payments: the gateway refused the request")
)
