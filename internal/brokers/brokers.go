// Package brokers opens the message broker a URL names, for the programs'
// flags (orderdemo -payments-service, sagabench -payments-service, pgsaga
// relay --broker).
package brokers

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"

	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/kafka"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// Schemes lists the URL forms Open takes, for messages.
const Schemes = "nats://host:4222 (NATS JetStream) or kafka://host:9092[,host:9092…] (Kafka)"

// ErrUnknownScheme is returned for a URL Open cannot tell the broker of.
var ErrUnknownScheme = errors.New("brokers: unknown broker URL")

// Check says what is wrong with a broker URL, without connecting.
func Check(raw string) error {
	_, _, err := parse(raw)
	return err
}

func parse(raw string) (scheme string, hosts []string, err error) {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "", nil, fmt.Errorf("%w %q: want %s", ErrUnknownScheme, raw, Schemes)
	}
	switch u.Scheme {
	case "nats", "tls":
		return "nats", nil, nil
	case "kafka":
		return "kafka", strings.Split(u.Host, ","), nil
	}
	return "", nil, fmt.Errorf("%w %q: want %s", ErrUnknownScheme, raw, Schemes)
}

// Open connects to the broker raw names.
func Open(raw string, logger *slog.Logger) (broker.Broker, error) {
	scheme, hosts, err := parse(raw)
	if err != nil {
		return nil, err
	}
	if scheme == "kafka" {
		return kafka.New(kafka.Config{Brokers: hosts, Logger: logger})
	}
	return natsjs.New(natsjs.Config{URL: raw, Logger: logger})
}

// Redact is raw with any password replaced, for messages.
func Redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(a broker URL that does not parse)"
	}
	return u.Redacted()
}
