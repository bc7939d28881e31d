package brokers_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"nats://127.0.0.1:4222", "tls://nats.example.com:4222", "kafka://127.0.0.1:9092", "kafka://a:9092,b:9092",
		"nats://u:p@a:4222,nats://u:p@b:4222"} {
		assert.NoError(t, brokers.Check(ok), ok)
	}
	for _, bad := range []string{"", "127.0.0.1:4222", "http://x:1", "nats://", "kafka:9092"} {
		assert.ErrorIs(t, brokers.Check(bad), brokers.ErrUnknownScheme, bad)
	}
	for _, bad := range []string{"nats://u:s3cr/3t@h:4222", "kafka://u:s3cr#3t@h:9092", "nats://u:12?s3cr3t@h:4222"} {
		err := brokers.Check(bad)
		assert.ErrorIs(t, err, brokerurl.ErrUnparseable, bad)
		assert.NotContains(t, err.Error(), "s3cr", bad)
	}
}

// A kafka:// URL with a user and password is refused, unless it says how
// to log in with them (sasl=plain, scram-sha-256, scram-sha-512): Kafka would be reached without them,
// silently. The refusal never holds the password.
func TestCheckKafkaCredentials(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"kafka://u:s3cr3t@h:9092", "kafka://u:s3cr3t@a:9092,b:9092", "kafka://u@h:9092", "kafka://u:s3cr3t@h:9092?tls=true",
		"kafka://u:s3cr3t@h:9092?sasl=scram-sha-1", "kafka://h:9092?sasl=plain", "kafka://h:9092?sasl=scram-sha-512", "kafka://u:s3cr3t@h:9092?sasl=plain&x=s3cr3t",
		"kafka://u:s3cr3t@h:9092?sasl=plain&tls=maybe", "kafka://u:s3cr3t@h:9092?sasl=s3cr3t", "kafka://u:s3cr3t@h:9092?sasl=plain&s3cr3t"} {
		err := brokers.Check(bad)
		if assert.Error(t, err, bad) {
			assert.ErrorIs(t, err, brokers.ErrKafkaLogin, bad)
			assert.NotContains(t, err.Error(), "s3cr3t", bad)
		}
	}
	for _, ok := range []string{"kafka://u:s3cr3t@h:9092?sasl=plain", "kafka://u:s3cr3t@a:9092,b:9092?sasl=PLAIN&tls=true", "kafka://h:9092?tls=true",
		"kafka://u:s3cr3t@h:9092?sasl=scram-sha-256", "kafka://u:s3cr3t@h:9092?sasl=SCRAM-SHA-512&tls=true"} {
		assert.NoError(t, brokers.Check(ok), ok)
	}
}
