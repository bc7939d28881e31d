package brokers_test

import (
	"context"
	"io"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/pgsaga/pgsaga/cmd/internal/brokers"
	"github.com/pgsaga/pgsaga/internal/testkafka"
)

// A kafka:// URL's login is the client's SASL login, against a cluster
// that asks for one: PLAIN and both SCRAMs (the SCRAM client is pgsaga's
// own) publish with the right password and are refused with a wrong one,
// and without a login the cluster refuses the client.
func TestKafkaURLsLogInWithSASL(t *testing.T) {
	t.Parallel()
	const user, password = "pgsaga", "s3/cr3t"
	for _, mech := range []struct{ kafka, url string }{
		{"PLAIN", "plain"}, {"SCRAM-SHA-256", "scram-sha-256"}, {"SCRAM-SHA-512", "scram-sha-512"},
	} {
		t.Run(mech.url, func(t *testing.T) {
			t.Parallel()
			cluster := testkafka.Start(t, kfake.EnableSASL(), kfake.Superuser(mech.kafka, user, password))
			hosts := strings.Join(cluster.Brokers(), ",")
			open := func(raw string) error {
				b, err := brokers.Open(raw, slog.New(slog.NewTextHandler(io.Discard, nil)))
				if err != nil {
					return err
				}
				defer b.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				if err := b.Provision(ctx, "logged.in"); err != nil {
					return err
				}
				return b.Publish(ctx, "logged.in", message.NewMessage(uuid.NewString(), []byte("x")))
			}
			login := url.UserPassword(user, password).String()
			require.NoError(t, open("kafka://"+login+"@"+hosts+"?sasl="+mech.url))
			wrong := url.UserPassword(user, "wrong").String()
			assert.Error(t, open("kafka://"+wrong+"@"+hosts+"?sasl="+mech.url), "a wrong password")
			assert.Error(t, open("kafka://"+hosts), "no login")
		})
	}
}
