package brokers_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/pgsaga/pgsaga/internal/brokers"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"nats://127.0.0.1:4222", "tls://nats.example.com:4222", "kafka://127.0.0.1:9092", "kafka://a:9092,b:9092"} {
		assert.NoError(t, brokers.Check(ok), ok)
	}
	for _, bad := range []string{"", "127.0.0.1:4222", "http://x:1", "nats://", "kafka:9092"} {
		assert.ErrorIs(t, brokers.Check(bad), brokers.ErrUnknownScheme, bad)
	}
	assert.Equal(t, "nats://user:xxxxx@h:4222", brokers.Redact("nats://user:secret@h:4222"))
}
