package natsjs_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// New's errors name the servers, never the password: not for a URL whose
// password holds an unencoded '/' or '#' (which nats.go's own errors would
// quote), nor for a server that cannot be reached.
func TestErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	for _, url := range []string{"nats://u:s3cr/3t@127.0.0.1:1", "nats://u:s3cr#3t@127.0.0.1:1"} {
		_, err := natsjs.New(natsjs.Config{URL: url})
		require.ErrorIs(t, err, broker.ErrInvalidConfig, url)
		require.ErrorIs(t, err, brokerurl.ErrUnparseable, url)
		assert.NotContains(t, err.Error(), "s3cr", url)
	}
	_, err := natsjs.New(natsjs.Config{URL: "nats://u:s3cr3t@127.0.0.1:1"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "connecting to nats://u@127.0.0.1:1")
	assert.NotContains(t, err.Error(), "s3cr3t")

	// A Kafka URL is one URL (its ',' may be in the password), while
	// nats.go splits it at the ','; its parse error is not passed on.
	_, err = natsjs.New(natsjs.Config{URL: "kafka://u:s3cr3t,x@127.0.0.1:1"})
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "s3cr3t")
}
