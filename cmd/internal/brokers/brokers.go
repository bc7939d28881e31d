// Package brokers opens the message broker a URL names, for the programs'
// flags (orderdemo -payments-service, sagabench -payments-service, pgsaga
// relay --broker). Messages name a broker by brokerurl.Describe, never by
// its URL.
package brokers

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"

	"github.com/IBM/sarama"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/kafka"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// Schemes lists the URL forms Open takes, for messages.
const Schemes = "nats://host:4222 (NATS JetStream) or kafka://[user:password@]host:9092[,host:9092…][?sasl=plain|scram-sha-256|scram-sha-512][&tls=true] (Kafka)"

// ErrUnknownScheme is returned for a URL Open cannot tell the broker of.
var ErrUnknownScheme = errors.New("brokers: unknown broker URL")

// ErrKafkaLogin is returned for a kafka:// URL whose login cannot be used
// as written: a user or password without sasl= (Kafka would be reached
// without them), sasl= without a user and password, a
// mechanism or parameter it does not know. The error's message never
// holds the password, nor a parameter's value.
var ErrKafkaLogin = errors.New("brokers: kafka:// URL")

// Check says what is wrong with a broker URL, without connecting: it is
// brokerurl.ErrUnparseable, ErrUnknownScheme or ErrKafkaLogin.
func Check(raw string) error {
	_, _, err := parse(raw)
	return err
}

// kafkaLogin is how a kafka:// URL logs in, as its userinfo and query
// say: with sasl=plain, SASL/PLAIN with its user and password (sasl=
// scram-sha-256 or scram-sha-512: SCRAM); with tls=true, over TLS (the
// system's roots).
type kafkaLogin struct {
	user, password string
	sasl           sarama.SASLMechanism // "": none
	tls            bool
}

func parseKafkaLogin(raw string) (kafkaLogin, error) {
	var l kafkaLogin
	bad := func(format string, args ...any) (kafkaLogin, error) {
		return kafkaLogin{}, fmt.Errorf("%w %s: %s", ErrKafkaLogin, brokerurl.Describe(raw), fmt.Sprintf(format, args...))
	}
	u, err := url.Parse(raw) // brokerurl.Parse took it
	if err != nil {
		return bad("unparseable")
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return bad("its query cannot be read")
	}
	for name, values := range q {
		if len(values) != 1 {
			return bad("give %q once", name)
		}
		switch v := values[0]; name {
		case "sasl":
			switch strings.ToLower(v) {
			case "plain":
				l.sasl = sarama.SASLTypePlaintext
			case "scram-sha-256":
				l.sasl = sarama.SASLTypeSCRAMSHA256
			case "scram-sha-512":
				l.sasl = sarama.SASLTypeSCRAMSHA512
			default:
				return bad("sasl= takes plain, scram-sha-256 or scram-sha-512 (for OAUTHBEARER or Kerberos give kafka.Config.Sarama in code)")
			}
		case "tls":
			switch strings.ToLower(v) {
			case "true", "1", "yes":
				l.tls = true
			case "false", "0", "no":
			default:
				return bad("tls= takes true or false")
			}
		default:
			return bad("a parameter it does not know (not shown): it takes sasl= (plain, scram-sha-256, scram-sha-512) and tls=true")
		}
	}
	if u.User != nil {
		l.user = u.User.Username()
		l.password, _ = u.User.Password()
	}
	switch {
	case l.sasl != "" && (l.user == "" || l.password == ""):
		return bad("sasl= needs a user and password: kafka://user:password@host:9092?sasl=scram-sha-512")
	case l.sasl == "" && u.User != nil:
		return bad("it gives a user or password, but says not how to log in with them, so Kafka would be reached without them: " +
			"add ?sasl=scram-sha-512 (or scram-sha-256, or plain: SASL/PLAIN, with &tls=true, or the password crosses the network readable)")
	}
	return l, nil
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
		if _, err := parseKafkaLogin(raw); err != nil {
			return "", nil, err
		}
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
		cfg, err := kafkaConfig(raw, hosts)
		if err != nil {
			return nil, err
		}
		cfg.Logger = logger
		return kafka.New(cfg)
	}
	return natsjs.New(natsjs.Config{URL: raw, Logger: logger})
}

// kafkaConfig is the configuration of the Kafka broker raw names, at
// hosts: its login, if it gives one, in Config.Sarama.
func kafkaConfig(raw string, hosts []string) (kafka.Config, error) {
	l, err := parseKafkaLogin(raw)
	if err != nil {
		return kafka.Config{}, err
	}
	cfg := kafka.Config{Brokers: hosts}
	if l.sasl != "" || l.tls {
		sc := sarama.NewConfig()
		if l.sasl != "" {
			sc.Net.SASL.Enable = true
			sc.Net.SASL.Mechanism = l.sasl
			sc.Net.SASL.Handshake = true
			sc.Net.SASL.User, sc.Net.SASL.Password = l.user, l.password
			if l.sasl != sarama.SASLTypePlaintext {
				sc.Net.SASL.SCRAMClientGeneratorFunc = newSCRAM(l.sasl)
			}
		}
		if l.tls {
			sc.Net.TLS.Enable = true
		}
		cfg.Sarama = sc
	}
	return cfg, nil
}
