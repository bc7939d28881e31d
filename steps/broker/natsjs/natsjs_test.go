package natsjs_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/internal/testout"
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

// The reconnection log names the server without a NATS token (a user
// alone in the URL), which the URL's own redaction leaves in.
func TestReconnectionLogHidesTheToken(t *testing.T) {
	t.Parallel()
	srv := testnats.Private(t)
	var logs testout.Buffer
	b, err := natsjs.New(natsjs.Config{URL: strings.Replace(srv.URL(), "://", "://s3cr3tt0ken@", 1),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	srv.Stop()
	srv.Start()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	logs.WaitFor(ctx, t, "reconnected to NATS")
	assert.Contains(t, logs.String(), strings.TrimPrefix(srv.URL(), "nats://"))
	testout.Hides(t, []string{"s3cr3tt0ken"}, logs.String())
}
