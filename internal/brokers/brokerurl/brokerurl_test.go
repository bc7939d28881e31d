package brokerurl_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// Every form of broker URL is described by its servers (and its user when
// it has a password), never with its password or token; one net/url cannot
// parse, or parses with some of the password outside the userinfo, is
// said to be unparseable, and no part of it is shown, in the description
// or in Parse's error.
func TestDescribeEveryForm(t *testing.T) {
	t.Parallel()
	const unparseable = ""
	cases := []struct {
		name, in, want string
		secrets        []string // none may be shown
	}{
		{"nats", "nats://127.0.0.1:4222", "nats://127.0.0.1:4222", nil},
		{"user and password", "nats://u:s3cr3t@h:4222", "nats://u@h:4222", []string{"s3cr3t"}},
		{"token", "nats://s3cr3t@h:4222", "nats://h:4222", []string{"s3cr3t"}},
		{"tls", "tls://u:s3cr3t@h:4222", "tls://u@h:4222", []string{"s3cr3t"}},
		{"several servers", "nats://u:s3cr3t@a:4222, nats://u:s3cr3t@b:4222", "nats://u@a:4222, nats://u@b:4222", []string{"s3cr3t"}},
		{"a server without a scheme", "nats://a:4222,b:4222", "nats://a:4222, nats://b:4222", nil},
		{"IPv6", "nats://u:s3cr3t@[::1]:4222", "nats://u@[::1]:4222", []string{"s3cr3t"}},
		{"encoded '/', '#', '?', '%', ','", "nats://u:s3%2Fc%23r%3F3%25t%2Cx@h:4222", "nats://u@h:4222", []string{"s3", "%2F", "c%23r", "3%25t", "%2C"}},
		{"'@' in the password", "nats://u:s3@cr3t@h:4222", "nats://u@h:4222", []string{"s3", "cr3t"}},
		{"a quote in the password", "nats://u:s3'cr3t@h:4222", "nats://u@h:4222", []string{"s3", "cr3t"}},
		{"kafka", "kafka://a:9092,b:9092", "kafka://a:9092, kafka://b:9092", nil},
		{"kafka, ',' in the password", "kafka://u:s3,cr3t@a:9092", "kafka://u@a:9092", []string{"s3", "cr3t"}},

		// What net/url cannot parse.
		{"'/' in the password", "nats://u:s3cr/3t@h:4222", unparseable, []string{"s3cr", "3t@"}},
		{"'#' in the password", "nats://u:s3cr#3t@h:4222", unparseable, []string{"s3cr", "#3t"}},
		{"'?' in the password", "nats://u:s3cr?3t@h:4222", unparseable, []string{"s3cr", "3t@"}},
		{"'%' in the password", "nats://u:s3cr%3t@h:4222", unparseable, []string{"s3cr", "3t@"}},
		{"a space in the password", "nats://u:s3 cr3t@h:4222", unparseable, []string{"s3", "cr3t"}},
		{"a double quote in the password", `nats://u:s3"cr3t@h:4222`, unparseable, []string{"s3", "cr3t"}},
		{"bad port", "nats://u:s3cr3t@h:port", unparseable, []string{"s3cr3t"}},
		{"kafka, '/' in the password", "kafka://u:s3cr/3t@h:9092", unparseable, []string{"s3cr", "3t@"}},

		// What net/url parses, but with some of the password elsewhere.
		{"'/' in the password after digits", "nats://u:1234/s3cr3t@h:4222", unparseable, []string{"1234", "s3cr3t"}},
		{"'#' in the password after digits", "nats://u:1234#s3cr3t@h:4222", unparseable, []string{"1234", "s3cr3t"}},
		{"'?' in the password after digits", "nats://u:1234?s3cr3t@h:4222", unparseable, []string{"1234", "s3cr3t"}},
		{"',' in the password after digits", "nats://u:1234,s3cr3t@h:4222", unparseable, []string{"1234", "s3cr3t"}},
		{"kafka, '/' in the password after digits", "kafka://u:1234/s3cr3t@h:9092", unparseable, []string{"1234", "s3cr3t"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got := brokerurl.Describe(c.in)
			_, err := brokerurl.Parse(c.in)
			if c.want == unparseable {
				assert.Equal(t, fmt.Sprintf("an unparseable broker URL (%d bytes)", len(c.in)), got)
				require.ErrorIs(t, err, brokerurl.ErrUnparseable)
			} else {
				assert.Equal(t, c.want, got)
				require.NoError(t, err)
			}
			testout.Hides(t, c.secrets, got, err)
		})
	}
}
