// Package brokerurl reads the URLs that name a message broker (NATS
// JetStream's nats:// and tls://, Kafka's kafka://) and describes them for
// people without their secrets: the programs' flags and steps/broker/natsjs
// share it.
package brokerurl

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// ErrUnparseable is returned for a URL that net/url cannot parse, or that
// it parses with a password, or some of it, outside the userinfo (see
// Parse). The error's message holds no part of the URL, only its length.
var ErrUnparseable = errors.New("unparseable broker URL")

type unparseableError struct{ size int }

func (e *unparseableError) Error() string {
	return unparseable(e.size) + " (percent-encode a '/', '#', '?', '%' or ',' in its password)"
}

func (e *unparseableError) Is(target error) bool { return target == ErrUnparseable }

func unparseable(size int) string { return fmt.Sprintf("an unparseable broker URL (%d bytes)", size) }

// Parse reads raw, a broker URL, into its servers, with userinfo as
// written. A kafka:// URL is one URL whose host lists the servers
// (kafka://a:9092,b:9092); any other is read as nats.go reads it: a
// comma-separated list of URLs, each trimmed, one without "://" taken as
// nats://. Empty, it has no servers.
//
// It refuses a URL with an '@' outside the userinfo, where net/url puts
// the rest of a password holding an unencoded '/', '?' or '#' (or, in a
// list, ','): its first part would be read as a host or port.
func Parse(raw string) ([]*url.URL, error) {
	if strings.HasPrefix(raw, "kafka://") {
		u, err := parseOne(raw, len(raw))
		if err != nil {
			return nil, err
		}
		var servers []*url.URL
		for _, host := range strings.Split(u.Host, ",") {
			servers = append(servers, &url.URL{Scheme: u.Scheme, User: u.User, Host: host})
		}
		return servers, nil
	}
	var servers []*url.URL
	for _, s := range strings.Split(raw, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !strings.Contains(s, "://") {
			if strings.Contains(s, "@") { // the end of a password holding a ','?
				return nil, &unparseableError{size: len(raw)}
			}
			s = "nats://" + s
		}
		u, err := parseOne(s, len(raw))
		if err != nil {
			return nil, err
		}
		servers = append(servers, u)
	}
	return servers, nil
}

// parseOne parses s, part of a URL of size bytes.
func parseOne(s string, size int) (*url.URL, error) {
	u, err := url.Parse(s) // its errors quote s
	if err != nil || strings.Contains(u.Opaque+u.EscapedPath()+u.RawQuery+u.EscapedFragment(), "@") {
		return nil, &unparseableError{size: size}
	}
	return u, nil
}

// Describe says which servers raw names, for people: each server's scheme,
// host and port, and its user when the URL gives a password too (a user
// alone is a NATS token), as in "nats://app@127.0.0.1:4222". It never
// shows a password, a token or raw itself: a URL Parse refuses is
// described as an unparseable broker URL of its length.
func Describe(raw string) string {
	servers, err := Parse(raw)
	if err != nil {
		return unparseable(len(raw))
	}
	if len(servers) == 0 {
		return "no broker URL"
	}
	described := make([]string, len(servers))
	for i, u := range servers {
		var user *url.Userinfo
		if _, ok := u.User.Password(); ok {
			user = url.User(u.User.Username())
		}
		described[i] = (&url.URL{Scheme: u.Scheme, User: user, Host: u.Host}).String()
	}
	return strings.Join(described, ", ")
}
