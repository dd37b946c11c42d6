// Signs webhook deliveries the way each provider does, with the provider's own SDK, for
// tests/webhook_signatures.rs. Reads a JSON config on stdin:
//
//   { "secrets": { "<provider>": { "primary": "…", "secondary": "…", "wrong": "…" } },
//     "twilio_public_url": "https://…" }
//
// and prints one JSON array of deliveries:
//
//   { "provider", "case", "accept": bool, "key", "route_path", "query", "headers": [[n, v]],
//     "body", "signed_by" }
//
// Where a provider's SDK only verifies (Slack), the signature is computed here with node's
// crypto and the SDK's verifier must accept it before it is printed; Shopify's SDK signs with
// its test helper and its verifier accepts the result too.

import crypto from 'node:crypto';
import { readFileSync } from 'node:fs';

import { sign as githubSign } from '@octokit/webhooks-methods';
import '@shopify/shopify-api/adapters/web-api';
import { ApiVersion, shopifyApi } from '@shopify/shopify-api';
import { getHmac as shopifyHmac } from '@shopify/shopify-api/test-helpers';
import { verifySlackRequest } from '@slack/bolt';
import { Webhook as StandardWebhook } from 'standardwebhooks';
import Stripe from 'stripe';
import twilio from 'twilio';

const config = JSON.parse(readFileSync(0, 'utf8'));
const now = Math.floor(Date.now() / 1000);
const TEN_MINUTES = 600;

const deliveries = [];
const id = (prefix) => `${prefix}${crypto.randomUUID().replaceAll('-', '')}`;

// One byte of the body changed after signing, in a field that is not the delivery's id.
const tamper = (body) => {
  const at = body.indexOf('4200');
  if (at < 0) throw new Error(`nothing to tamper with in ${body}`);
  return `${body.slice(0, at)}4201${body.slice(at + 4)}`;
};

// Adds the accepted and refused variants of one provider's delivery. `make(case, secret,
// timestamp)` returns { key, headers, body, route_path?, query? } signed by the SDK;
// `signatureHeaders` are the headers removed for the missing-signature case.
async function cases(provider, signedBy, make, signatureHeaders, { timestamped }) {
  const secrets = config.secrets[provider];
  const push = (name, accept, delivery) =>
    deliveries.push({
      provider,
      case: name,
      accept,
      route_path: '',
      query: null,
      signed_by: signedBy,
      ...delivery,
    });
  push('valid', true, await make('valid', secrets.primary, now));
  push('rotated-secret', true, await make('rotated', secrets.secondary, now));
  push('wrong-secret', false, await make('wrong', secrets.wrong, now));
  const tampered = await make('tampered', secrets.primary, now);
  push('tampered-body', false, { ...tampered, body: tamper(tampered.body) });
  const unsigned = await make('unsigned', secrets.primary, now);
  push('missing-signature', false, {
    ...unsigned,
    headers: unsigned.headers.filter(([name]) => !signatureHeaders.includes(name)),
  });
  if (timestamped) {
    push('stale-timestamp', false, await make('stale', secrets.primary, now - TEN_MINUTES));
    push('future-timestamp', false, await make('future', secrets.primary, now + TEN_MINUTES));
  }
}

// GitHub: @octokit/webhooks-methods `sign`.
await cases(
  'github',
  '@octokit/webhooks-methods sign',
  async (_case, secret) => {
    const key = crypto.randomUUID();
    const body = JSON.stringify({
      action: 'opened',
      number: 4200,
      pull_request: { node_id: id('PR_') },
      repository: { full_name: 'o/r' },
    });
    return {
      key,
      body,
      headers: [
        ['content-type', 'application/json'],
        ['x-github-event', 'pull_request'],
        ['x-github-delivery', key],
        ['x-hub-signature-256', await githubSign(secret, body)],
      ],
    };
  },
  ['x-hub-signature-256'],
  { timestamped: false },
);

// Stripe: stripe.webhooks.generateTestHeaderString.
const stripe = new Stripe('sk_test_idemgate_signing_only');
await cases(
  'stripe',
  'stripe webhooks.generateTestHeaderString',
  (_case, secret, timestamp) => {
    const key = id('evt_');
    const body = JSON.stringify({
      id: key,
      object: 'event',
      type: 'payment_intent.succeeded',
      data: { object: { id: id('pi_'), amount: 4200 } },
    });
    const header = stripe.webhooks.generateTestHeaderString({ payload: body, secret, timestamp });
    return {
      key,
      body,
      headers: [
        ['content-type', 'application/json; charset=utf-8'],
        ['stripe-signature', header],
      ],
    };
  },
  ['stripe-signature'],
  { timestamped: true },
);

// Shopify: the SDK's test helper signs; its webhook validator must accept the result.
const shopifyApps = new Map();
const shopify = (secret) => {
  if (!shopifyApps.has(secret)) {
    shopifyApps.set(
      secret,
      shopifyApi({
        apiKey: 'idemgate-test',
        apiSecretKey: secret,
        scopes: [],
        hostName: 'hooks.example.com',
        apiVersion: ApiVersion.October24,
        isEmbeddedApp: false,
        logger: { level: 0 },
      }),
    );
  }
  return shopifyApps.get(secret);
};
await cases(
  'shopify',
  '@shopify/shopify-api test-helpers getHmac, accepted by webhooks.validate',
  async (name, secret) => {
    const key = crypto.randomUUID();
    const body = JSON.stringify({
      id: crypto.randomInt(2 ** 47),
      admin_graphql_api_id: id('gid://shopify/Order/'),
      total_price: '4200.00',
    });
    const headers = [
      ['content-type', 'application/json'],
      ['x-shopify-topic', 'orders/create'],
      ['x-shopify-hmac-sha256', shopifyHmac(body, secret)],
      ['x-shopify-shop-domain', 'test-shop.myshopify.com'],
      ['x-shopify-api-version', '2024-10'],
      ['x-shopify-webhook-id', key],
      ['x-shopify-triggered-at', new Date(now * 1000).toISOString()],
    ];
    const check = await shopify(secret).webhooks.validate({
      rawBody: body,
      rawRequest: new Request('https://hooks.example.com/webhooks/shopify', {
        method: 'POST',
        headers,
        body,
      }),
    });
    if (!check.valid) throw new Error(`Shopify's validator refused its own ${name} signature: ${JSON.stringify(check)}`);
    return { key, body, headers };
  },
  ['x-shopify-hmac-sha256'],
  { timestamped: false },
);

// Standard Webhooks: the reference library's Webhook.sign.
await cases(
  'standard-webhooks',
  'standardwebhooks Webhook.sign',
  (_case, secret, timestamp) => {
    const key = id('msg_');
    const body = JSON.stringify({ type: 'invoice.paid', data: { invoice: id('inv_'), amount: 4200 } });
    const signature = new StandardWebhook(secret).sign(key, new Date(timestamp * 1000), body);
    return {
      key,
      body,
      headers: [
        ['content-type', 'application/json'],
        ['webhook-id', key],
        ['webhook-timestamp', String(timestamp)],
        ['webhook-signature', signature],
      ],
    };
  },
  ['webhook-signature'],
  { timestamped: true },
);

// Slack: no Slack SDK signs; the signature is computed here as Slack documents it, and
// @slack/bolt's verifySlackRequest must accept it (for a timestamp it judges current).
await cases(
  'slack',
  "node crypto, accepted by @slack/bolt verifySlackRequest",
  (name, secret, timestamp) => {
    const key = id('Ev');
    const body = JSON.stringify({
      token: 'legacy-unused',
      team_id: 'T0001',
      api_app_id: 'A0001',
      type: 'event_callback',
      event_id: key,
      event_time: timestamp,
      event: { type: 'app_mention', user: 'U0001', text: 'total 4200', ts: `${timestamp}.000100` },
    });
    const mac = crypto.createHmac('sha256', secret).update(`v0:${timestamp}:${body}`).digest('hex');
    const headers = {
      'x-slack-request-timestamp': timestamp,
      'x-slack-signature': `v0=${mac}`,
    };
    if (timestamp === now) verifySlackRequest({ signingSecret: secret, body, headers });
    return {
      key,
      body,
      headers: [
        ['content-type', 'application/json'],
        ['x-slack-request-timestamp', String(timestamp)],
        ['x-slack-signature', headers['x-slack-signature']],
      ],
    };
  },
  ['x-slack-signature'],
  { timestamped: true },
);

// Twilio: getExpectedTwilioSignature over the public URL and the form parameters (checked by
// validateRequest); one JSON delivery too, signed through bodySHA256 (validateRequestWithBody).
const twilioUrl = (routePath, query) => `${config.twilio_public_url}${routePath}?${query}`;
await cases(
  'twilio',
  'twilio getExpectedTwilioSignature, accepted by validateRequest',
  (_case, token) => {
    const key = crypto.randomUUID();
    const params = {
      MessageSid: id('SM'),
      AccountSid: 'AC0001',
      From: '+15005550006',
      To: '+15005550001',
      Body: 'order 4200 shipped',
    };
    const routePath = '/sms';
    const query = 'tenant=acme&lang=en';
    const signature = twilio.getExpectedTwilioSignature(token, twilioUrl(routePath, query), params);
    if (!twilio.validateRequest(token, signature, twilioUrl(routePath, query), params)) {
      throw new Error("Twilio's validateRequest refused its own signature");
    }
    return {
      key,
      route_path: routePath,
      query,
      body: new URLSearchParams(params).toString(),
      headers: [
        ['content-type', 'application/x-www-form-urlencoded'],
        ['i-twilio-idempotency-token', key],
        ['x-twilio-signature', signature],
      ],
    };
  },
  ['x-twilio-signature'],
  { timestamped: false },
);
for (const [name, accept, token, change] of [
  ['json-valid', true, 'primary', false],
  ['json-tampered-body', false, 'primary', true],
]) {
  const secret = config.secrets.twilio[token];
  const key = crypto.randomUUID();
  const body = JSON.stringify({ event: 'message.delivered', amount: 4200 });
  const query = `bodySHA256=${twilio.getExpectedBodyHash(body)}`;
  const url = twilioUrl('/events', query);
  const signature = twilio.getExpectedTwilioSignature(secret, url, {});
  if (!twilio.validateRequestWithBody(secret, signature, url, body)) {
    throw new Error("Twilio's validateRequestWithBody refused its own signature");
  }
  deliveries.push({
    provider: 'twilio',
    case: name,
    accept,
    key,
    route_path: '/events',
    query,
    signed_by: 'twilio getExpectedBodyHash + getExpectedTwilioSignature, accepted by validateRequestWithBody',
    body: change ? tamper(body) : body,
    headers: [
      ['content-type', 'application/json'],
      ['i-twilio-idempotency-token', key],
      ['x-twilio-signature', signature],
    ],
  });
}

process.stdout.write(JSON.stringify(deliveries));
