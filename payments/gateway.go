package payments

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/google/uuid"
)

// GatewayError is an answer from the gateway that says nothing about the
// outcome (5xx, 429): transient, retry with the same key.
type GatewayError struct {
	Status int
	Body   string
}

// Error implements error.
func (e *GatewayError) Error() string {
	return fmt.Sprintf("payments: gateway answered %d: %s", e.Status, e.Body)
}

// GatewayClient talks to a payment gateway, passing the step's stable
// idempotency key downstream so the gateway deduplicates retries. A timeout
// or a lost connection is an unknown outcome: the caller must retry with the
// same key, never record a result.
type GatewayClient struct {
	// BaseURL of the gateway, e.g. http://127.0.0.1:8080.
	BaseURL string
	// HTTP is the client; its Timeout bounds every call. Default: a client
	// with a 2s timeout.
	HTTP *http.Client
}

// Charge takes amountCents from account's card for order and returns the
// gateway's charge id. The order id travels as metadata (order_id), as real
// gateways take it: reconciliation finds every charge of an order with it,
// including one the gateway made again after forgetting the key.
func (c *GatewayClient) Charge(ctx context.Context, key, account string, order uuid.UUID, amountCents int64) (string, error) {
	return c.call(ctx, "/v1/charges", key, map[string]any{"account_id": account, "amount_cents": amountCents, "order_id": order.String()})
}

// Refund returns amountCents of chargeID to account's card and returns the
// gateway's refund id.
func (c *GatewayClient) Refund(ctx context.Context, key, account, chargeID string, amountCents int64) (string, error) {
	return c.call(ctx, "/v1/refunds", key, map[string]any{"account_id": account, "amount_cents": amountCents, "charge_id": chargeID})
}

func (c *GatewayClient) call(ctx context.Context, path, key string, body map[string]any) (string, error) {
	hc := c.HTTP
	if hc == nil {
		hc = &http.Client{Timeout: 2 * time.Second}
	}
	b, err := json.Marshal(body)
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+path, bytes.NewReader(b))
	if err != nil {
		return "", fmt.Errorf("payments: gateway request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("payments: gateway call %s (outcome unknown): %w", path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return "", fmt.Errorf("payments: gateway call %s (outcome unknown): %w", path, err)
	}
	var out struct {
		ID    string `json:"id"`
		Error string `json:"error"`
	}
	_ = json.Unmarshal(raw, &out)
	switch {
	case resp.StatusCode == http.StatusOK && out.ID != "":
		return out.ID, nil
	case resp.StatusCode == http.StatusPaymentRequired:
		return "", fmt.Errorf("%w: %s", ErrDeclined, out.Error)
	case resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests:
		return "", &GatewayError{Status: resp.StatusCode, Body: string(raw)}
	default:
		// A request the gateway will never accept: a bug, not a retry.
		return "", fmt.Errorf("%w (%d): %s", ErrBadGatewayRequest, resp.StatusCode, raw)
	}
}
