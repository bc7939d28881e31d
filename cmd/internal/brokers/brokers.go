// Package brokers opens the message broker a URL names, for the programs'
// flags (orderdemo -payments-service, sagabench -payments-service, pgsaga
// relay --broker). Messages name a broker by brokerurl.Describe, never by
// its URL.
package brokers

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/kafka"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// Schemes lists the URL forms Open takes, for messages.
const Schemes = "nats://host:4222 (NATS JetStream) or kafka://host:9092[,host:9092…] (Kafka)"

// ErrUnknownScheme is returned for a URL Open cannot tell the broker of.
var ErrUnknownScheme = errors.New("brokers: unknown broker URL")

// Check says what is wrong with a broker URL, without connecting: it is
// brokerurl.ErrUnparseable or ErrUnknownScheme.
func Check(raw string) error {
	_, _, err := parse(raw)
	return err
}

func parse(raw string) (scheme string, hosts []string, err error) {
	servers, err := brokerurl.Parse(raw)
	if err != nil {
		return "", nil, fmt.Errorf("brokers: %w: want %s", err, Schemes)
	}
	if len(servers) == 0 {
		return "", nil, fmt.Errorf("%w: none given: want %s", ErrUnknownScheme, Schemes)
	}
	scheme = servers[0].Scheme
	for _, s := range servers {
		if s.Host == "" {
			return "", nil, fmt.Errorf("%w: a server without a host: want %s", ErrUnknownScheme, Schemes)
		}
		hosts = append(hosts, s.Host)
	}
	if !strings.HasPrefix(raw, scheme+"://") {
		return "", nil, fmt.Errorf("%w: no scheme: want %s", ErrUnknownScheme, Schemes)
	}
	switch scheme {
	case "nats", "tls":
		return "nats", nil, nil
	case "kafka":
		return "kafka", hosts, nil
	}
	return "", nil, fmt.Errorf("%w %s: want %s", ErrUnknownScheme, brokerurl.Describe(raw), Schemes)
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
